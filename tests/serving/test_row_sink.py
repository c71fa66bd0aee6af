"""A slot row staged from a pull's verified chunks as they land (adapter_fabric.serving.row_sink) equals one staged from the file.

Real PEFT adapters on the tiny model; chunks fed in random order, at chunk
sizes that split lora_B rows across chunks; rows recycled from a bigger
tenant (the padding must be zeroed again); a file dtype other than the pool's;
non-finite values; a sink handed over before its bytes all landed.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch

from adapter_fabric.errors import InvalidArgument, InvalidTensors
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.row_sink import RowSink
from adapter_fabric.serving.shape_only import ShapeOnlyModel
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, Manifest, build_manifest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("row-sink")
    return {
        "wide": make_peft_adapter(root / "wide", base_model=build_tiny_model(), r=8, target_modules=ALL, seed=1),
        "narrow": make_peft_adapter(root / "narrow", base_model=build_tiny_model(), r=3, target_modules=("q_proj", "down_proj"), seed=2),
    }


def shapes_of_tiny() -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in build_tiny_model().named_modules() if isinstance(m, torch.nn.Linear)}


def _manifest(directory: Path, chunk_size: int) -> Manifest:
    return build_manifest("sink/x", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, chunk_size)


def _feed(sink: RowSink, directory: Path, manifest: Manifest, seed: int = 0, skip: int | None = None) -> None:
    data = memoryview((directory / WEIGHTS_FILE).read_bytes())
    order = list(range(manifest.weights.chunk_count))
    random.Random(seed).shuffle(order)
    for index in order:
        if index != skip:
            offset, length = manifest.weights.chunk_span(index)
            sink.add(index, data[offset : offset + length])


def _model(max_rank: int = 8) -> MultiLoraModel:
    return MultiLoraModel(build_tiny_model(), slots=2, max_rank=max_rank, device="cpu")  # it adapts its base in place: one each


# 1000 bytes = 250 fp32 values: lora_B rows of rank 8 or 3 straddle chunk boundaries.
@pytest.mark.parametrize("chunk_size", [1000, 4096, 1 << 20])
@pytest.mark.parametrize("name", ["wide", "narrow"])
def test_a_row_staged_from_chunks_equals_the_row_staged_from_the_file(adapters, name, chunk_size) -> None:
    directory = adapters[name]
    manifest = _manifest(directory, chunk_size)
    expected = _model().prepare(directory, "x").staged  # a fresh pool: a row never used before
    model = _model()
    model.recycle(model.prepare(adapters["wide"], "dirty"))  # the next row is a recycled one, full of another tenant
    sink = model.row_sink(manifest)
    assert sink is not None and not sink.complete
    _feed(sink, directory, manifest, seed=chunk_size)
    assert sink.complete
    prepared = model.prepared_from(sink, manifest, directory / WEIGHTS_FILE, "x")
    assert torch.equal(prepared.staged.row, expected.row), "padding, untouched modules and B^T must match the file's staging"
    assert torch.equal(prepared.staged.scaling, expected.scaling)
    assert prepared.staged.ranks == expected.ranks and prepared.content_id == manifest.content_id
    slot, _ = model.commit(prepared)
    assert model.adapter_id_for(slot) == manifest.content_id


def test_a_file_dtype_other_than_the_pools_is_converted(adapters) -> None:
    """fp32 adapter bytes into a bf16 pool: the same values as staging the file would give."""
    directory = adapters["wide"]
    manifest = _manifest(directory, 4096)
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.bfloat16)
    expected = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.bfloat16).prepare(directory, "x").staged
    sink = shaped.row_sink(manifest)
    _feed(sink, directory, manifest)
    assert torch.equal(sink.finish().row, expected.row)


def test_a_sink_is_refused_when_a_chunk_boundary_could_split_an_element(adapters) -> None:
    manifest = _manifest(adapters["wide"], 1002)  # not a multiple of fp32's 4 bytes
    assert _model().row_sink(manifest) is None


def test_a_row_handed_over_before_every_byte_landed_is_refused(adapters) -> None:
    directory = adapters["narrow"]
    manifest = _manifest(directory, 4096)
    model = _model()
    sink = model.row_sink(manifest)
    _feed(sink, directory, manifest, skip=manifest.weights.chunk_count - 1)
    assert not sink.complete
    with pytest.raises(InvalidArgument, match="its pull did not finish"):
        model.prepared_from(sink, manifest, directory / WEIGHTS_FILE, "x")
    sink.abandon()


@pytest.mark.parametrize("chunk_size", [1000, 4096])
@pytest.mark.parametrize("tensor,where", [(0, "first"), (1, "last"), (-1, "first"), (-1, "last"), (-2, "last")])
def test_non_finite_values_are_refused_naming_the_tensor(adapters, tmp_path, chunk_size, tensor, where) -> None:
    """In the pool's dtype a chunk's pieces end to end are checked in one pass: a NaN at either end of any piece, the
    first or last of a chunk's run or inside it, is found and named."""
    directory = tmp_path / "nan"
    directory.mkdir()
    (directory / CONFIG_FILE).write_bytes((adapters["narrow"] / CONFIG_FILE).read_bytes())
    data = bytearray((adapters["narrow"] / WEIGHTS_FILE).read_bytes())
    manifest = _manifest(adapters["narrow"], chunk_size)
    victim = manifest.tensors[tensor]
    at = victim.begin if where == "first" else victim.end - 4
    struct.pack_into("<f", data, manifest.index.data_offset + at, float("nan"))
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))
    manifest = _manifest(directory, chunk_size)
    model = _model()
    sink = model.row_sink(manifest)
    _feed(sink, directory, manifest)
    with pytest.raises(InvalidTensors, match=f"tensor '{victim.name}' holds 1 non-finite"):
        sink.finish()


@pytest.mark.parametrize("chunk_size", [1000, 4096])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_value_that_overflows_the_pools_dtype_is_refused_wherever_it_sits_in_a_piece_split_over_chunks(adapters, tmp_path, chunk_size, where) -> None:
    """Checked piece by piece as chunks land, in the pool's dtype: a finite fp32 value beyond fp16's range is inf in
    an fp16 row, wherever it sits in a piece split across chunks."""
    directory = tmp_path / "big"
    directory.mkdir()
    (directory / CONFIG_FILE).write_bytes((adapters["wide"] / CONFIG_FILE).read_bytes())
    data = bytearray((adapters["wide"] / WEIGHTS_FILE).read_bytes())
    manifest = _manifest(adapters["wide"], chunk_size)
    victim = max(manifest.tensors, key=lambda t: t.end - t.begin)  # spans several chunks
    at = victim.begin if where == "first" else victim.end - 4
    struct.pack_into("<f", data, manifest.index.data_offset + at, 1e6)  # fp16's largest finite value is 65504
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))
    manifest = _manifest(directory, chunk_size)
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float16)
    sink = shaped.row_sink(manifest)
    _feed(sink, directory, manifest, seed=chunk_size)
    with pytest.raises(InvalidTensors, match=f"tensor '{victim.name}' holds 1 non-finite value\\(s\\) in torch.float16"):
        sink.finish()
    clean = _manifest(adapters["wide"], chunk_size)
    sink = shaped.row_sink(clean)
    _feed(sink, adapters["wide"], clean)
    assert torch.isfinite(sink.finish().row).all()
