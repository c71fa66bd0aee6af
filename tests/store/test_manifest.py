"""Manifests of real PEFT adapters: chunk planning, digests, proto/JSON round trips, and refusing manifests that lie."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.store import SMALL_CHUNK
from adapter_fabric.format.content_id import content_id
from blake3 import blake3

from adapter_fabric.errors import IncompatibleFormat, IntegrityError, InvalidAdapter, InvalidAdapterId, InvalidArgument, InvalidConfig, InvalidHeader
from adapter_fabric.store.digests import whole_file_blake3
from adapter_fabric.store.manifest import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    FileEntry,
    Manifest,
    adapter_digest,
    build_manifest,
    hash_bytes,
    plan_chunks,
)
from adapter_fabric.format.safetensors_index import read_index
from adapter_fabric.v1 import fabric_pb2


@pytest.fixture(scope="module")
def adapters(store_adapters: dict[str, Path]) -> dict[str, Path]:
    return store_adapters


def _build(directory: Path, adapter_id: str = "team/a", chunk_size: int = SMALL_CHUNK) -> Manifest:
    return build_manifest(adapter_id, (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, chunk_size)


@pytest.fixture(scope="module")
def manifest(adapters: dict[str, Path]) -> Manifest:
    return _build(adapters["a"])


# ---------------------------------------------------------------- pure helpers


def test_plan_chunks_covers_the_file_exactly() -> None:
    assert plan_chunks(0, 4) == []
    assert plan_chunks(4, 4) == [(0, 4)]
    assert plan_chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]


@given(size=st.integers(0, 10_000), chunk=st.integers(1, 3000))
def test_plan_chunks_is_contiguous_and_bounded(size: int, chunk: int) -> None:
    plan = plan_chunks(size, chunk)
    assert sum(length for _, length in plan) == size
    assert all(offset == i * chunk for i, (offset, _) in enumerate(plan))
    assert all(0 < length <= chunk for _, length in plan)


@pytest.mark.parametrize(("size", "chunk"), [(-1, 4), (4, 0), (4, -2), (4, True), (4, 1 << 31)])
def test_plan_chunks_refuses_bad_numbers(size: int, chunk: int) -> None:
    with pytest.raises(InvalidArgument, match=str(size) if size < 0 else "chunk size"):
        plan_chunks(size, chunk)


def test_adapter_digest_is_the_documented_formula() -> None:
    c, w = "a" * 64, "b" * 64
    expected = blake3(b"adapter-fabric adapter digest v2\0" + c.encode() + b"\0" + w.encode()).hexdigest()
    assert adapter_digest(c, w) == expected
    assert adapter_digest(w, c) != expected
    with pytest.raises(InvalidArgument, match=WEIGHTS_FILE):
        adapter_digest(c, "B" * 64)


# ---------------------------------------------------------------- building


def test_build_manifest_describes_the_peft_files(adapters: dict[str, Path], manifest: Manifest) -> None:
    weights_path = adapters["a"] / WEIGHTS_FILE
    data = weights_path.read_bytes()
    config_bytes = (adapters["a"] / CONFIG_FILE).read_bytes()
    assert [f.name for f in manifest.files] == [CONFIG_FILE, WEIGHTS_FILE]
    chunks = [blake3(data[offset : offset + SMALL_CHUNK]).digest() for offset in range(0, len(data), SMALL_CHUNK)]
    # The documented root (fabric/store/digests.py), recomputed here from the bytes alone.
    root = blake3(b"adapter-fabric file root v2\0" + struct.pack("<QI", len(data), SMALL_CHUNK) + b"".join(chunks)).hexdigest()
    assert manifest.weights.size == len(data) and manifest.weights.root == root
    assert list(manifest.weights.chunk_digests) == chunks
    config_root = blake3(b"adapter-fabric file root v2\0" + struct.pack("<QI", len(config_bytes), SMALL_CHUNK)
                         + b"".join(blake3(config_bytes[o : o + SMALL_CHUNK]).digest() for o in range(0, len(config_bytes), SMALL_CHUNK))).hexdigest()
    assert manifest.file(CONFIG_FILE).root == config_root
    assert manifest.config_json == config_bytes
    assert manifest.digest == adapter_digest(manifest.files[0].root, manifest.weights.root)
    assert manifest.weights.chunk_count == len(chunks) > 1
    index = read_index(weights_path)
    assert manifest.tensors == index.tensors and manifest.header_size == index.header_size
    assert manifest.config.r == 8
    assert len(manifest.modules) == 4
    assert manifest.content_id == content_id(manifest.weights.root, manifest.config, manifest.modules) != 0


def test_chunk_size_is_part_of_the_identity(adapters: dict[str, Path], manifest: Manifest) -> None:
    """Digest scheme 2 builds the root over the chunk digests, so another chunking is another digest (and content id)."""
    other = _build(adapters["a"], chunk_size=1 << 20)
    assert other.weights.chunk_count == 1
    assert other.digest != manifest.digest and other.content_id != manifest.content_id
    assert _build(adapters["a"], "other/id", chunk_size=1 << 20).digest == other.digest  # the id never is


def test_the_whole_file_blake3_is_b3sum(adapters: dict[str, Path]) -> None:
    """What a client keys an upload by: the plain BLAKE3 of the file, independent of chunking."""
    data = (adapters["a"] / WEIGHTS_FILE).read_bytes()
    assert whole_file_blake3(adapters["a"] / WEIGHTS_FILE) == blake3(data).hexdigest()


def test_another_config_is_another_adapter_with_the_same_weights(adapters: dict[str, Path], manifest: Manifest) -> None:
    other = _build(adapters["a_alpha"])
    assert other.weights == manifest.weights
    assert other.digest != manifest.digest and other.content_id != manifest.content_id


@pytest.mark.parametrize(
    ("name", "adapter_id", "error", "words"),
    [
        ("a", "bad//id", InvalidAdapterId, "segment"),
        ("dora", "x", InvalidConfig, "use_dora=True"),
        ("corrupt_header", "x", InvalidHeader, "not valid JSON"),
    ],
)
def test_build_manifest_refuses_bad_input(adapters: dict[str, Path], name: str, adapter_id: str, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        _build(adapters[name], adapter_id)


def test_verify_chunk_names_the_file_chunk_and_offset(manifest: Manifest, adapters: dict[str, Path]) -> None:
    data = (adapters["a"] / WEIGHTS_FILE).read_bytes()
    weights = manifest.weights
    offset, length = weights.chunk_span(2)
    weights.verify_chunk(2, data[offset : offset + length])
    bad = bytearray(data[offset : offset + length])
    bad[7] ^= 1
    with pytest.raises(IntegrityError, match=rf"{WEIGHTS_FILE}: chunk 2 at offset {offset} .*does not match"):
        weights.verify_chunk(2, bytes(bad))
    with pytest.raises(IntegrityError, match=rf"chunk 2 at offset {offset} has {length - 1} bytes, expected {length}"):
        weights.verify_chunk(2, data[offset : offset + length - 1])
    with pytest.raises(InvalidArgument, match=f"chunk index {weights.chunk_count} is out of range"):
        weights.chunk_span(weights.chunk_count)


# ---------------------------------------------------------------- round trips


def test_proto_round_trip(manifest: Manifest) -> None:
    pb = manifest.to_proto()
    wire = fabric_pb2.Manifest.FromString(pb.SerializeToString())
    assert Manifest.from_proto(wire) == manifest
    assert pb.peft.r == 8 and list(pb.peft.target_modules) == ["q_proj", "v_proj"]
    assert all(len(d) == 32 for d in pb.files[1].chunk_digests)
    assert pb.digest_scheme == fabric_pb2.DIGEST_SCHEME_BLAKE3_CHUNKS


def test_a_manifest_of_another_digest_scheme_is_refused_by_name(manifest: Manifest) -> None:
    pb = manifest.to_proto()
    pb.ClearField("digest_scheme")  # what a scheme-1 peer sends: it predates the field
    with pytest.raises(IncompatibleFormat, match=r"digest scheme 1 \(sha256: it predates the field\); this node reads and writes scheme 2"):
        Manifest.from_proto(pb)
    pb.digest_scheme = 7
    with pytest.raises(IncompatibleFormat, match="digest scheme 7"):
        Manifest.from_proto(pb)
    old = json.loads(manifest.to_json())
    old["format"] = 1
    with pytest.raises(IncompatibleFormat, match="manifest format 1 holds digest scheme 1"):
        Manifest.from_json(json.dumps(old).encode())


def test_json_round_trip_and_with_id(manifest: Manifest) -> None:
    assert Manifest.from_json(manifest.to_json()) == manifest
    renamed = manifest.with_id("other/id")
    assert renamed.adapter_id == "other/id" and renamed.digest == manifest.digest
    with pytest.raises(InvalidAdapterId):
        manifest.with_id("../x")


def _lying(manifest: Manifest, mutate) -> fabric_pb2.Manifest:
    pb = manifest.to_proto()
    mutate(pb)
    return fabric_pb2.Manifest.FromString(pb.SerializeToString())


def _set_size(pb: fabric_pb2.Manifest, size: int) -> None:
    pb.files[1].size = size


def _flip_chunk(pb: fabric_pb2.Manifest) -> None:
    pb.files[1].chunk_digests[0] = bytes(32)


@pytest.mark.parametrize(
    ("mutate", "error", "words"),
    [
        (lambda pb: _set_size(pb, pb.files[1].size + 1), IntegrityError, "does not match its chunk digests"),
        (lambda pb: _set_size(pb, pb.files[1].size + SMALL_CHUNK), IntegrityError, "chunk digests for"),
        (lambda pb: setattr(pb.files[1], "root", "0" * 64), IntegrityError, "does not match its chunk digests"),
        (_flip_chunk, IntegrityError, "does not match its chunk digests"),
        (lambda pb: setattr(pb, "digest", "1" * 64), IntegrityError, "does not match its files"),
        (lambda pb: setattr(pb, "digest", "XYZ"), InvalidAdapter, "64 lowercase hex"),
        (lambda pb: setattr(pb, "content_id", pb.content_id ^ 1), IntegrityError, "content_id"),
        (lambda pb: setattr(pb, "config_json", pb.config_json + b" "), IntegrityError, CONFIG_FILE),
        (lambda pb: setattr(pb, "adapter_id", "a//b"), InvalidAdapterId, "segment"),
        (lambda pb: pb.files[1].chunk_digests.append(bytes(32)), IntegrityError, "chunk digests for"),
        (lambda pb: setattr(pb.files[1], "chunk_size", 0), InvalidAdapter, "chunk size 0"),
        (lambda pb: pb.files.pop(), InvalidAdapter, "must be exactly"),
        (lambda pb: setattr(pb.tensors[0], "end", pb.tensors[0].end + 4), InvalidHeader, "tensor index is invalid"),
        (lambda pb: pb.tensors.pop(0), InvalidHeader, "leaves a gap"),
        (lambda pb: setattr(pb.tensors[1], "name", pb.tensors[0].name), InvalidAdapter, "duplicated or not in offset order"),
        (lambda pb: pb.tensors.insert(0, pb.tensors.pop(1)), InvalidAdapter, "duplicated or not in offset order"),
        (lambda pb: setattr(pb.tensors[0], "name", "__metadata__"), InvalidHeader, "not a tensor name"),
        (lambda pb: setattr(pb.tensors[0], "dtype", "F99"), InvalidHeader, "unknown dtype"),
        (lambda pb: pb.tensors[0].shape.append(2), InvalidHeader, "tensor index is invalid"),
        (lambda pb: pb.tensors.pop(), IntegrityError, "adds up to"),
        (lambda pb: setattr(pb, "header_size", pb.header_size + 8), IntegrityError, "adds up to"),
        (lambda pb: setattr(pb.peft, "r", 16), IntegrityError, "peft fields"),
    ],
)
def test_from_proto_refuses_a_lying_manifest(manifest: Manifest, mutate, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        Manifest.from_proto(_lying(manifest, mutate))


def test_a_consistent_lie_about_the_bytes_is_another_adapter(manifest: Manifest, adapters: dict[str, Path]) -> None:
    """A manifest whose chunk digest, root, digest and content id were all recomputed for other bytes is self-consistent:
    it names another adapter, and the real bytes fail at that chunk (only a signature ties a digest to an author)."""
    data = bytearray((adapters["a"] / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    entry = hash_bytes(WEIGHTS_FILE, bytes(data), SMALL_CHUNK)
    lying = replace(manifest, files=(manifest.files[0], entry), digest=adapter_digest(manifest.files[0].root, entry.root),
                    content_id=content_id(entry.root, manifest.config, manifest.modules))
    assert lying.digest != manifest.digest
    last = manifest.weights.chunk_count - 1
    offset, length = manifest.weights.chunk_span(last)
    real = (adapters["a"] / WEIGHTS_FILE).read_bytes()[offset : offset + length]
    with pytest.raises(IntegrityError, match=f"chunk {last} at offset {offset}"):
        lying.weights.verify_chunk(last, real)


def test_file_entry_checks_itself() -> None:
    entry = hash_bytes(CONFIG_FILE, b"x" * 10, 4)
    assert entry.chunk_count == 3 and entry.chunk_span(2) == (8, 2)
    with pytest.raises(InvalidAdapter, match="not one of"):
        replace(entry, name="README.md")
    with pytest.raises(IntegrityError, match="2 chunk digests for 10 bytes in chunks of 4: expected 3"):
        replace(entry, chunk_digests=entry.chunk_digests[:2])
    with pytest.raises(InvalidAdapter, match="chunk 1 digest is not 32 raw bytes"):
        replace(entry, chunk_digests=(entry.chunk_digests[0], b"short", entry.chunk_digests[2]))
    with pytest.raises(IntegrityError, match="does not match its chunk digests"):
        replace(entry, chunk_digests=(entry.chunk_digests[2], entry.chunk_digests[1], entry.chunk_digests[0]))  # reordered
    assert FileEntry.from_proto(entry.to_proto()) == entry
