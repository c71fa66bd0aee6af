"""A corpus of malformed adapters, ids, manifests and Stage streams, each made from a real PEFT adapter.

Every adapter case starts from a directory written by PEFT's ``save_pretrained``
(``adapter_fabric.serving.tiny.make_peft_adapter``) and breaks exactly one thing, by editing the
safetensors header, the data, the tensors (re-saved with ``safetensors``) or the
config. Each case names the error type the library must raise and a regex its
message must match, and says where it is refused:

- ``stage``: the store refuses it (``AdapterStore.stage``, the Stage RPC), and so
  does ``MultiLoraModel.prepare`` on the raw directory;
- ``promote``: a well-formed adapter the store accepts, which the model refuses
  (``prepare``, or the Promote RPC) without touching a slot.

``python -m tests.support.hostile_corpus OUT`` (from the repository root) writes the corpus to OUT for a look.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from adapter_fabric.errors import (
    FabricError,
    IncompatibleAdapter,
    InvalidAdapter,
    InvalidConfig,
    InvalidHeader,
    InvalidTensors,
)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers.0.self_attn."
Q_A, Q_B = PREFIX + "q_proj.lora_A.weight", PREFIX + "q_proj.lora_B.weight"
V_A, V_B = PREFIX + "v_proj.lora_A.weight", PREFIX + "v_proj.lora_B.weight"
RANK = 4  # the good adapter's r (tiny Llama: hidden 64, so lora_A is [4, 64])


@dataclass(frozen=True)
class AdapterCase:
    name: str
    build: Callable[[Path, Path], None]  # (good adapter dir, empty output dir)
    error: type[FabricError]
    match: str
    refused_at: str = "stage"  # or "promote"


# ---------------------------------------------------------------- raw file helpers


def split(weights: Path) -> tuple[list[tuple[str, Any]], bytes]:
    """The header as its ordered (key, value) pairs, and the data section."""
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n], object_pairs_hook=list), raw[8 + n :]


def encode_header(pairs: Any) -> bytes:
    """JSON of ordered pairs (duplicates kept), padded with spaces to 8 bytes as safetensors does."""

    def dump(value: Any) -> str:
        if isinstance(value, list) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value) + "}"
        if isinstance(value, list):
            return "[" + ",".join(dump(v) for v in value) + "]"
        return json.dumps(value)

    text = dump([tuple(p) for p in pairs]) if isinstance(pairs, list) else json.dumps(pairs)
    data = text.encode()
    return data + b" " * (-len(data) % 8)


def entries(pairs: list) -> list:
    """Each tensor entry as a mutable dict (order kept)."""
    return [(name, dict(value) if isinstance(value, list) else value) for name, value in pairs]


def dict_pairs(items: list) -> list:
    return [(name, list(value.items()) if isinstance(value, dict) else value) for name, value in items]


def write_file(out: Path, good: Path, header: bytes, data: bytes, *, length: int | None = None) -> None:
    shutil.copy(good / CONFIG, out / CONFIG)
    n = len(header) if length is None else length
    (out / WEIGHTS).write_bytes(struct.pack("<Q", n) + header + data)


def raw_edit(fn: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    """A case that rewrites the weights file's bytes."""

    def build(good: Path, out: Path) -> None:
        shutil.copy(good / CONFIG, out / CONFIG)
        (out / WEIGHTS).write_bytes(fn((good / WEIGHTS).read_bytes()))

    return build


def header_text(text: str, data: bytes = b"") -> Callable[[Path, Path], None]:
    """A case whose header is exactly ``text`` (padded), followed by ``data``."""

    def build(good: Path, out: Path) -> None:
        encoded = text.encode()
        write_file(out, good, encoded + b" " * (-len(encoded) % 8), data)

    return build


def header_edit(fn: Callable[[list], Any]) -> Callable[[Path, Path], None]:
    """A case that edits the parsed header (a list of (name, dict)); the data is kept."""

    def build(good: Path, out: Path) -> None:
        pairs, data = split(good / WEIGHTS)
        items = entries(pairs)
        result = fn(items)
        write_file(out, good, encode_header(dict_pairs(items) if result is None else result), data)

    return build


def entry(items: list, name: str) -> dict:
    return next(value for key, value in items if key == name)


def with_length(fn: Callable[[int, int], int]) -> Callable[[Path, Path], None]:
    """A case that keeps the header bytes but writes another header length ``fn(n, file size)``."""

    def build(good: Path, out: Path) -> None:
        raw = (good / WEIGHTS).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        shutil.copy(good / CONFIG, out / CONFIG)
        (out / WEIGHTS).write_bytes(struct.pack("<Q", fn(n, len(raw))) + raw[8:])

    return build


def flip_in_header(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def fn(raw: bytes) -> bytes:
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8 : 8 + n]
        assert len(old) == len(new) and old in header
        return raw[:8] + header.replace(old, new, 1) + raw[8 + n :]

    return fn


# ---------------------------------------------------------------- tensor-level helpers (re-saved by safetensors)


def tensors_edit(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, Path], None]:
    """A case that edits the real tensors and saves a valid safetensors file (PEFT's metadata kept)."""

    def build(good: Path, out: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(good / WEIGHTS, "pt") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        fn(tensors)
        shutil.copy(good / CONFIG, out / CONFIG)
        save_file(tensors, out / WEIGHTS, metadata=metadata)

    return build


def config_edit(**changes: Any) -> Callable[[Path, Path], None]:
    def build(good: Path, out: Path) -> None:
        raw = json.loads((good / CONFIG).read_text())
        raw.update(changes)
        shutil.copy(good / WEIGHTS, out / WEIGHTS)
        (out / CONFIG).write_text(json.dumps(raw, indent=2))

    return build


def config_bytes(data: bytes) -> Callable[[Path, Path], None]:
    def build(good: Path, out: Path) -> None:
        shutil.copy(good / WEIGHTS, out / WEIGHTS)
        (out / CONFIG).write_bytes(data)

    return build


def missing(name: str) -> Callable[[Path, Path], None]:
    def build(good: Path, out: Path) -> None:
        for file in (CONFIG, WEIGHTS):
            if file != name:
                shutil.copy(good / file, out / file)

    return build


def _set(tensor_name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(tensors: dict[str, torch.Tensor]) -> None:
        tensors[tensor_name] = tensors[tensor_name].clone()
        tensors[tensor_name][1, 2] = value

    return fn


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.pop(name)


def _replace(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = make(tensors[name]).contiguous()

    return fn


def _rename_layer(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if ".layers.0.self_attn.q_proj." in k]:
        tensors[key.replace(".layers.0.", ".layers.9.")] = tensors.pop(key)


def _move(items: list, name: str, delta: int) -> None:
    offsets = entry(items, name)["data_offsets"]
    entry(items, name)["data_offsets"] = [offsets[0] + delta, offsets[1] + delta]


def _shift_from(items: list, first: str, delta: int) -> None:
    """Move ``first`` and every tensor after it in the data section by ``delta``."""
    start = entry(items, first)["data_offsets"][0]
    for key, value in items:
        if key != "__metadata__" and value["data_offsets"][0] >= start:
            _move(items, key, delta)


def _duplicate_name(items: list) -> list:
    pairs = dict_pairs(items)
    return pairs + [pairs[-1]]


def _duplicate_metadata(items: list) -> list:
    pairs = dict_pairs(items)
    return [pairs[0], *pairs]


# ---------------------------------------------------------------- the corpus


ADAPTER_CASES: tuple[AdapterCase, ...] = (
    # Truncation and the header length.
    AdapterCase("empty_file", raw_edit(lambda raw: b""), InvalidHeader, r"8-byte header length; got only 0"),
    AdapterCase("truncated_in_length", raw_edit(lambda raw: raw[:5]), InvalidHeader, r"got only 5 bytes"),
    AdapterCase("truncated_in_header", raw_edit(lambda raw: raw[:300]), InvalidHeader, r"truncated header"),
    AdapterCase("truncated_in_data", raw_edit(lambda raw: raw[:-10]), InvalidHeader, r"file is short.*10 missing"),
    AdapterCase("header_length_beyond_file", with_length(lambda n, size: size), InvalidHeader, r"truncated header"),
    AdapterCase("header_length_over_limit", with_length(lambda n, size: 200_000_000), InvalidHeader, r"exceeds the limit"),
    AdapterCase("header_length_u64_max", with_length(lambda n, size: 2**64 - 1), InvalidHeader, r"exceeds the limit"),
    AdapterCase("header_length_zero", with_length(lambda n, size: 0), InvalidHeader, r"header length is 0"),
    AdapterCase("header_length_short_of_json", with_length(lambda n, size: n - 8), InvalidHeader, r"not valid JSON|file is short"),
    # The header's JSON.
    AdapterCase("invalid_utf8", raw_edit(flip_in_header(b"q_proj", b"q\xff\xfe_oj")), InvalidHeader, r"not valid UTF-8"),
    AdapterCase("invalid_json", raw_edit(flip_in_header(b'"dtype":"F32"', b'"dtype" "F32"')), InvalidHeader, r"not valid JSON"),
    AdapterCase("json_nesting_bomb", header_text("[" * 50_000), InvalidHeader, r"not acceptable JSON|not valid JSON"),
    AdapterCase("header_is_array", header_text("[]"), InvalidHeader, r"must be an object, not an array"),
    AdapterCase("header_is_number", header_text("42"), InvalidHeader, r"must be an object, not a number"),
    AdapterCase("header_is_string", header_text('"weights"'), InvalidHeader, r"must be an object, not a string"),
    AdapterCase("header_is_null", header_text("null"), InvalidHeader, r"must be an object, not null"),
    AdapterCase("no_tensors", header_text('{"__metadata__":{"format":"pt"}}'), InvalidTensors, r"holds no tensors"),
    # __metadata__.
    AdapterCase(
        "metadata_not_object",
        header_edit(lambda items: [("__metadata__", ["pt"]), *dict_pairs(items[1:])]),
        InvalidHeader,
        r"__metadata__ must be an object mapping strings to strings, not an array",
    ),
    AdapterCase(
        "metadata_value_not_string",
        header_edit(lambda items: [("__metadata__", [("format", 1)]), *dict_pairs(items[1:])]),
        InvalidHeader,
        r"__metadata__\['format'\] must be a string, not a number",
    ),
    AdapterCase("metadata_duplicated", header_edit(_duplicate_metadata), InvalidHeader, r"duplicate __metadata__"),
    # Tensor entries: dtype, shape, offsets.
    AdapterCase("unknown_dtype", header_edit(lambda items: entry(items, Q_A).update(dtype="F17")), InvalidHeader, r"unknown dtype 'F17'"),
    AdapterCase("dtype_not_string", header_edit(lambda items: entry(items, Q_A).update(dtype=32)), InvalidHeader, r"unknown dtype 32"),
    AdapterCase("integer_dtype", header_edit(lambda items: entry(items, Q_A).update(dtype="I32")), InvalidTensors, r"dtype I32.*must be one of"),
    AdapterCase(
        "shape_and_size_disagree", header_edit(lambda items: entry(items, Q_A).update(shape=[RANK, 65])), InvalidHeader, r"needs more than the 1024 bytes"
    ),
    AdapterCase(
        "shape_smaller_than_size", header_edit(lambda items: entry(items, Q_A).update(shape=[RANK, 32])), InvalidHeader, r"is 512 bytes but data_offsets span 1024"
    ),
    AdapterCase("dtype_size_disagree", header_edit(lambda items: entry(items, Q_A).update(dtype="F16")), InvalidHeader, r"is 512 bytes but data_offsets span 1024"),
    AdapterCase("negative_shape", header_edit(lambda items: entry(items, Q_A).update(shape=[-4, -64])), InvalidHeader, r"shape\[0\]=-4 must be a non-negative"),
    AdapterCase("shape_not_list", header_edit(lambda items: entry(items, Q_A).update(shape=256)), InvalidHeader, r"shape must be a list"),
    AdapterCase("shape_overflow", header_edit(lambda items: entry(items, Q_A).update(shape=[2**63, 2**63, 2**63])), InvalidHeader, r"needs more than"),
    AdapterCase("extra_entry_key", header_edit(lambda items: entry(items, Q_A).update(crc32=0)), InvalidHeader, r"extra \['crc32'\]"),
    AdapterCase("missing_entry_key", header_edit(lambda items: entry(items, Q_A).pop("shape") and None), InvalidHeader, r"missing \['shape'\]"),
    AdapterCase("overlapping_offsets", header_edit(lambda items: _move(items, Q_B, -512)), InvalidHeader, r"overlap"),
    AdapterCase("gapped_offsets", header_edit(lambda items: _shift_from(items, Q_B, 64)), InvalidHeader, r"gap of 64 bytes"),
    AdapterCase("duplicated_tensor_name", header_edit(_duplicate_name), InvalidHeader, r"duplicate tensor name"),
    AdapterCase("offsets_reversed", header_edit(lambda items: entry(items, Q_A).update(data_offsets=[1024, 0])), InvalidHeader, r"must satisfy 0 <= begin <= end"),
    AdapterCase("offsets_beyond_u64", header_edit(lambda items: entry(items, Q_A).update(data_offsets=[0, 2**64])), InvalidHeader, r"must satisfy 0 <= begin <= end < 2\*\*64"),
    AdapterCase("offsets_not_a_pair", header_edit(lambda items: entry(items, Q_A).update(data_offsets=[0, 512, 1024])), InvalidHeader, r"must be a pair of integers"),
    AdapterCase("offsets_past_end_of_file", header_edit(lambda items: _grow_last(items)), InvalidHeader, r"file is short"),
    AdapterCase("trailing_bytes", raw_edit(lambda raw: raw + b"\0" * 16), InvalidHeader, r"16 trailing bytes"),
    # LoRA structure against the config.
    AdapterCase("missing_lora_B", tensors_edit(_drop(V_B)), InvalidTensors, r"lora_B is missing"),
    AdapterCase("missing_lora_A", tensors_edit(_drop(Q_A)), InvalidTensors, r"lora_A is missing"),
    AdapterCase("rank_disagrees_with_config", config_edit(r=8), InvalidTensors, r"rank 4 but the config gives rank 8"),
    AdapterCase("rank_A_disagrees_with_B", tensors_edit(_replace(Q_B, lambda t: t[:, :2])), InvalidTensors, r"rank mismatch"),
    AdapterCase("three_d_tensor", tensors_edit(_replace(Q_A, lambda t: t.reshape(RANK, 8, 8))), InvalidTensors, r"3-D"),
    AdapterCase(
        "extra_bias_tensor",
        tensors_edit(lambda t: t.update({PREFIX + "q_proj.bias": torch.zeros(64)})),
        InvalidTensors,
        r"not PEFT LoRA weights",
    ),
    AdapterCase("untargeted_module", config_edit(target_modules=["q_proj"]), InvalidTensors, r"does not target it"),
    # The config.
    AdapterCase("config_not_json", config_bytes(b"{r: 4"), InvalidConfig, r"not valid JSON"),
    AdapterCase("config_not_utf8", config_bytes(b'{"r": "\xff"}'), InvalidConfig, r"not valid UTF-8"),
    AdapterCase("config_not_lora", config_edit(peft_type="IA3"), InvalidConfig, r"peft_type='IA3' is not supported"),
    AdapterCase("config_dora", config_edit(use_dora=True), InvalidConfig, r"use_dora"),
    AdapterCase("config_rank_zero", config_edit(r=0), InvalidConfig, r"r <= 0"),
    AdapterCase("config_missing", missing(CONFIG), InvalidAdapter, r"does not exist"),
    AdapterCase("weights_missing", missing(WEIGHTS), InvalidAdapter, r"does not exist"),
    # Well-formed, stored as bytes, refused by the model (no slot touched).
    AdapterCase("nan_weight", tensors_edit(_set(Q_A, float("nan"))), InvalidTensors, r"non-finite", refused_at="promote"),
    AdapterCase("inf_weight", tensors_edit(_set(V_B, float("-inf"))), InvalidTensors, r"non-finite", refused_at="promote"),
    AdapterCase(
        "in_features_wrong_for_model",
        tensors_edit(_replace(Q_A, lambda t: t[:, :32])),
        IncompatibleAdapter,
        r"shape \(in=32, out=64\) differs from the model's linear \(in=64, out=64\)",
        refused_at="promote",
    ),
    AdapterCase(
        "out_features_wrong_for_model",
        tensors_edit(_replace(V_B, lambda t: torch.cat([t, t]))),
        IncompatibleAdapter,
        r"differs from the model's linear",
        refused_at="promote",
    ),
    AdapterCase("module_not_in_model", tensors_edit(_rename_layer), IncompatibleAdapter, r"layers\.9.*does not exist in the model", refused_at="promote"),
)


def _grow_last(items: list) -> None:
    """The last tensor claims 4 more rows than the file holds (offsets past the end of the data)."""
    last = max((value for key, value in items if key != "__metadata__"), key=lambda value: value["data_offsets"][1])
    rows, cols = last["shape"]
    last["shape"] = [rows + 4, cols]
    last["data_offsets"] = [last["data_offsets"][0], last["data_offsets"][1] + 4 * cols * 4]


#: A real rank-32 adapter (its config agrees): refused by the pool's max_rank, not by the store.
RANK_ABOVE_POOL = AdapterCase(
    "rank_above_pool_max_rank", lambda good, out: None, IncompatibleAdapter, r"rank 32 is above the pool's max_rank 16", refused_at="promote"
)

#: Ids the store and the node must refuse (InvalidAdapterId, INVALID_ARGUMENT), by case name.
BAD_IDS: dict[str, str] = {
    "dotdot": "..",
    "dotdot_segment": "team/../etc",
    "dot_segment": "team/./x",
    "leading_slash": "/etc/passwd",
    "trailing_slash": "team/",
    "double_slash": "team//x",
    "nul": "team\0x",
    "ten_kb": "a" * 10_240,
    "empty": "",
    "space": "team x",
    "backslash": "team\\..\\x",
    "percent_escape": "team%2F..%2Fx",
    "unicode": "tëam",
    "newline": "team\nx",
}


def build_adapters(root: Path, base_model=None) -> dict[str, Path]:
    """The good adapter plus one directory per case, all under ``root``."""
    from adapter_fabric.serving.tiny import make_peft_adapter

    good = make_peft_adapter(root / "good", base_model=base_model, r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=7)
    dirs = {"good": good}
    for case in ADAPTER_CASES:
        out = root / case.name
        out.mkdir()
        case.build(good, out)
        dirs[case.name] = out
    dirs[RANK_ABOVE_POOL.name] = make_peft_adapter(
        root / RANK_ABOVE_POOL.name, base_model=base_model, r=32, lora_alpha=32, target_modules=["q_proj"], seed=8
    )
    return dirs


ALL_ADAPTER_CASES: tuple[AdapterCase, ...] = (*ADAPTER_CASES, RANK_ABOVE_POOL)
CASES_BY_NAME = {case.name: case for case in ALL_ADAPTER_CASES}

if __name__ == "__main__":
    for name, path in build_adapters(Path(sys.argv[1])).items():
        print(name, path)
