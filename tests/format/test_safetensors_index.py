"""adapter_fabric.format.safetensors_index: good files written by the real safetensors library, bad headers built by hand."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from adapter_fabric.errors import InvalidHeader
from adapter_fabric.format import safetensors_index
from adapter_fabric.format.safetensors_index import (
    DTYPE_BITS,
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    SafetensorsIndex,
    TensorInfo,
    check_entries,
    header_length,
    parse_header,
    read_index,
)
from adapter_fabric.serving.tiny import make_peft_adapter


def _raw(header: Any, data: bytes = b"") -> bytes:
    """A file: 8-byte length, the header (an object is JSON-encoded, str/bytes are used as is), then data."""
    if isinstance(header, bytes):
        text = header
    elif isinstance(header, str):
        text = header.encode()
    else:
        text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _entry(dtype: str = "F32", shape: list = [2], offsets: list = [0, 8]) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _assert_matches_library(index: SafetensorsIndex, path: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        assert sorted(index.names) == sorted(f.keys())
        assert index.metadata == (f.metadata() or {})
        for name in f.keys():
            info = index.tensor(name)
            sl = f.get_slice(name)
            assert info.dtype == sl.get_dtype()
            assert list(info.shape) == sl.get_shape()
            # The offsets point at the tensor's own bytes.
            raw = path.read_bytes()[index.data_offset + info.begin : index.data_offset + info.end]
            assert raw == bytes(f.get_tensor(name).reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------- good files


def test_library_file_parses_and_agrees_with_safe_open(tmp_path: Path) -> None:
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "h": torch.ones(5, dtype=torch.float16),
        "b": torch.ones(2, 3, dtype=torch.bfloat16),
        "i": torch.arange(3, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(3.0),
    }
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    index = read_index(path)
    _assert_matches_library(index, path)
    assert index.file_size == path.stat().st_size
    assert [t.begin for t in index.tensors] == sorted(t.begin for t in index.tensors)
    assert index.tensor("scalar").shape == ()
    assert index.tensor("w").nbytes == 48
    # The same header from the whole file, from exactly 8 + N bytes, and with the file size.
    data = path.read_bytes()
    assert parse_header(data) == index
    assert parse_header(data[: index.data_offset]) == index
    assert parse_header(data[: index.data_offset], len(data)) == index
    assert header_length(data[:8]) == index.header_size


def test_real_peft_adapter_parses(tmp_path: Path) -> None:
    adapter = make_peft_adapter(tmp_path / "a", r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    path = adapter / "adapter_model.safetensors"
    index = read_index(path)
    _assert_matches_library(index, path)
    assert len(index.tensors) == 2 * 3 * 2  # A and B, three modules, two layers
    assert index.data_size + index.data_offset == path.stat().st_size


def test_empty_file_of_no_tensors(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    safetensors.torch.save_file({}, str(path))
    index = read_index(path)
    assert index.tensors == () and index.data_size == 0 and index.file_size == path.stat().st_size


def test_dtype_table_agrees_with_the_library() -> None:
    for name, torch_dtype in safetensors.torch._TYPES.items():
        assert DTYPE_SIZES[name] == torch.empty((), dtype=torch_dtype).element_size(), name
    assert set(DTYPE_SIZES) <= set(DTYPE_BITS)
    assert {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "U16", "U32", "U64", "C64"} <= set(DTYPE_BITS)


def test_sub_byte_dtype_counts_bits() -> None:
    data = _raw({"x": _entry("F4", [4], [0, 2])}, b"\0\0")
    index = parse_header(data, len(data))
    assert index.tensor("x").nbytes == 2
    with pytest.raises(InvalidHeader, match=r"tensor 'x'.*12 bits, not a whole number of bytes"):
        parse_header(_raw({"x": _entry("F4", [3], [0, 2])}))


def test_metadata_is_optional_and_whitespace_padding_is_fine() -> None:
    index = parse_header(_raw(json.dumps({"x": _entry()}) + "    ", b"\0" * 8))
    assert index.metadata == {} and index.tensor("x").end == 8


# ---------------------------------------------------------------- the length prefix


def test_fewer_than_eight_bytes() -> None:
    with pytest.raises(InvalidHeader, match="8-byte header length; got only 3 bytes"):
        header_length(b"\1\2\3")
    with pytest.raises(InvalidHeader, match="got only 0 bytes"):
        parse_header(b"")


def test_zero_header_length() -> None:
    with pytest.raises(InvalidHeader, match="header length is 0"):
        parse_header(struct.pack("<Q", 0))


def test_header_length_over_limit() -> None:
    with pytest.raises(InvalidHeader, match=f"header length {MAX_HEADER_BYTES + 1} bytes exceeds the limit of {MAX_HEADER_BYTES}"):
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1))
    with pytest.raises(InvalidHeader, match="header length 2 bytes exceeds the limit of 1 bytes"):
        parse_header(_raw("{}"), max_header_bytes=1)
    # Little-endian: the same bytes read big-endian would be tiny.
    with pytest.raises(InvalidHeader, match=f"header length {2**56} bytes"):
        header_length(b"\0" * 7 + b"\1")


def test_truncated_header() -> None:
    data = _raw({"x": _entry()})
    with pytest.raises(InvalidHeader, match=rf"truncated header: the length says {len(data) - 8} bytes but only 10 follow"):
        parse_header(data[:18])


def test_truncated_header_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(_raw({"x": _entry()})[:20])
    with pytest.raises(InvalidHeader, match=r"short\.safetensors: truncated header: .* the file has only 12 after it"):
        read_index(path)


# ---------------------------------------------------------------- JSON


def test_header_not_utf8() -> None:
    with pytest.raises(InvalidHeader, match=r"not valid UTF-8 \(byte 2 of 4\)"):
        parse_header(_raw(b'{"\xff}'))


def test_header_not_json() -> None:
    with pytest.raises(InvalidHeader, match="not valid JSON: Expecting"):
        parse_header(_raw('{"x": '))


def test_header_not_an_object() -> None:
    with pytest.raises(InvalidHeader, match="header JSON must be an object, not an array"):
        parse_header(_raw("[1, 2]"))


def test_header_with_absurd_integer() -> None:
    with pytest.raises(InvalidHeader, match="not acceptable JSON"):
        parse_header(_raw('{"x": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}'))


def test_duplicate_tensor_name() -> None:
    one = json.dumps(_entry())
    with pytest.raises(InvalidHeader, match="duplicate tensor name 'x'"):
        parse_header(_raw(f'{{"x": {one}, "x": {one}}}'))


# ---------------------------------------------------------------- __metadata__


def test_metadata_not_an_object() -> None:
    with pytest.raises(InvalidHeader, match="__metadata__ must be an object mapping strings to strings, not an array"):
        parse_header(_raw({"__metadata__": ["pt"]}))


def test_metadata_value_not_a_string() -> None:
    with pytest.raises(InvalidHeader, match=r"__metadata__\['step'\] must be a string, not a number"):
        parse_header(_raw({"__metadata__": {"format": "pt", "step": 3}}))


def test_metadata_duplicate_key() -> None:
    with pytest.raises(InvalidHeader, match="duplicate __metadata__ key 'format'"):
        parse_header(_raw('{"__metadata__": {"format": "pt", "format": "np"}}'))
    with pytest.raises(InvalidHeader, match="duplicate __metadata__: JSON readers"):
        parse_header(_raw('{"__metadata__": {}, "__metadata__": {}}'))


# ---------------------------------------------------------------- tensor entries


def test_entry_not_an_object() -> None:
    with pytest.raises(InvalidHeader, match="tensor 'x': entry must be an object .* not a string"):
        parse_header(_raw({"x": "F32"}))


def test_entry_missing_key() -> None:
    with pytest.raises(InvalidHeader, match=r"tensor 'x': entry must have exactly .* \(missing \['shape'\], extra \[\]\)"):
        parse_header(_raw({"x": {"dtype": "F32", "data_offsets": [0, 0]}}))


def test_entry_extra_key() -> None:
    entry = _entry() | {"stride": [1]}
    with pytest.raises(InvalidHeader, match=r"tensor 'x': .* \(missing \[\], extra \['stride'\]\)"):
        parse_header(_raw({"x": entry}))


def test_entry_duplicate_key() -> None:
    with pytest.raises(InvalidHeader, match="duplicate key in tensor 'x': 'dtype'"):
        parse_header(_raw('{"x": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}'))


def test_unknown_dtype() -> None:
    with pytest.raises(InvalidHeader, match="tensor 'x': unknown dtype 'float32'; known: BOOL"):
        parse_header(_raw({"x": _entry("float32")}))
    with pytest.raises(InvalidHeader, match="tensor 'x': unknown dtype 4"):
        parse_header(_raw({"x": _entry(4)}))


@pytest.mark.parametrize(
    "shape, rule",
    [
        ("2", r"shape must be a list of non-negative integers, not a string"),
        ([2, -1], r"shape\[1\]=-1 must be a non-negative integer"),
        ([2.0], r"shape\[0\]=2.0 must be a non-negative integer"),
        ([True], r"shape\[0\]=True must be a non-negative integer"),
        ([2**64], rf"shape\[0\]={2**64} must be a non-negative integer below 2\*\*64"),
    ],
)
def test_bad_shape(shape: Any, rule: str) -> None:
    with pytest.raises(InvalidHeader, match=f"tensor 'x': {rule}"):
        parse_header(_raw({"x": _entry(shape=shape)}))


@pytest.mark.parametrize(
    "offsets, rule",
    [
        ([0], r"data_offsets=\[0\] must be a pair of integers"),
        ([0, 8, 16], r"data_offsets=\[0, 8, 16\] must be a pair"),
        ([0, 8.0], r"data_offsets=\[0, 8.0\] must be a pair of integers"),
        ("0-8", r"data_offsets='0-8' must be a pair"),
        ([8, 0], r"data_offsets=\[8, 0\] must satisfy 0 <= begin <= end"),
        ([-8, 0], r"data_offsets=\[-8, 0\] must satisfy 0 <= begin <= end"),
    ],
)
def test_bad_offsets(offsets: Any, rule: str) -> None:
    with pytest.raises(InvalidHeader, match=f"tensor 'x': {rule}"):
        parse_header(_raw({"x": _entry(offsets=offsets)}))


def test_byte_size_disagrees_with_offsets() -> None:
    with pytest.raises(InvalidHeader, match=r"tensor 'x': shape \[1\] of F32 is 4 bytes but data_offsets span 8 bytes"):
        parse_header(_raw({"x": _entry(shape=[1])}))
    with pytest.raises(InvalidHeader, match=r"tensor 'x': shape \[3\] of F32 needs more than the 8 bytes its data_offsets span"):
        parse_header(_raw({"x": _entry(shape=[3])}))
    with pytest.raises(InvalidHeader, match=r"tensor 'x': shape \[2\] of F64 needs more than the 8 bytes"):
        parse_header(_raw({"x": _entry("F64")}))


def test_huge_shape_stops_at_the_declared_span() -> None:
    # Many huge dims: refused as soon as the running product passes the span, never multiplied out.
    shape = [2**63] * 100_000
    with pytest.raises(InvalidHeader, match=r"tensor 'x': shape .* needs more than the 8 bytes its data_offsets span"):
        parse_header(_raw({"x": _entry(shape=shape)}))


def test_zero_dim_with_huge_dims_is_empty() -> None:
    index = parse_header(_raw({"x": _entry(shape=[2**63, 0, 2**63], offsets=[0, 0])}))
    assert index.tensor("x").nbytes == 0 and index.data_size == 0


# ---------------------------------------------------------------- layout


def test_gap_at_start() -> None:
    with pytest.raises(InvalidHeader, match="tensor 'x': data_offsets begin 4 leaves a gap of 4 bytes at the start"):
        parse_header(_raw({"x": _entry(offsets=[4, 12])}))


def test_gap_between_tensors() -> None:
    header = {"a": _entry(offsets=[0, 8]), "b": _entry(offsets=[12, 20])}
    with pytest.raises(InvalidHeader, match=r"tensor 'b': data_offsets begin 12 leaves a gap of 4 bytes after tensor 'a' ends \(at 8\)"):
        parse_header(_raw(header))


def test_overlapping_tensors() -> None:
    header = {"a": _entry(offsets=[0, 8]), "b": _entry(offsets=[4, 12])}
    with pytest.raises(InvalidHeader, match=r"tensor 'b': data_offsets \[4, 12\] overlap tensor 'a' which ends at 8"):
        parse_header(_raw(header))
    same = {"a": _entry(offsets=[0, 8]), "b": _entry(offsets=[0, 8])}
    with pytest.raises(InvalidHeader, match=r"data_offsets \[0, 8\] overlap tensor"):
        parse_header(_raw(same))


def test_file_short() -> None:
    data = _raw({"x": _entry()}, b"\0" * 5)
    with pytest.raises(InvalidHeader, match=rf"file is short: .* = {len(data) + 3} bytes expected, file has {len(data)} \(3 missing\)"):
        parse_header(data, len(data))


def test_file_with_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file({"x": torch.ones(2)}, str(path))
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(b"junk")
    with pytest.raises(InvalidHeader, match=rf"t\.safetensors: file has 4 trailing bytes .* {size} bytes expected, file has {size + 4}"):
        read_index(path)


def test_file_short_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file({"x": torch.ones(2)}, str(path))
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(InvalidHeader, match=rf"file is short: .* {size} bytes expected, file has {size - 1} \(1 missing\)"):
        read_index(path)


def test_missing_tensor_lookup() -> None:
    index = parse_header(_raw({"x": _entry()}))
    assert "x" in index and "y" not in index
    assert index.tensor("x") == TensorInfo("x", "F32", (2,), 0, 8)
    with pytest.raises(InvalidHeader, match="tensor 'y' is not in the header; it holds 1 tensors: x"):
        index.tensor("y")


# ---------------------------------------------------------------- a manifest's claimed entries: the quick acceptance


class _Str(str):
    pass


class _Int(int):
    pass


_NAMES = ["w", "__metadata__", _Str("w"), 3, None]
_DTYPES = ["BF16", "F32", "F4", "BOOL", "bf16", "Q8", 16, None]
_DIMS = [0, 1, 2, 3, 16, 4096, 2**64 - 1, 2**64, -1, True, _Int(2), 2.0, "2"]
_OFFSETS = [0, 1, 2, 3, 4, 6, 8, 16, 32, 64, 131072, 2**64 - 1, 2**64, -1, True, _Int(8), 8.0]


def _detailed(info: TensorInfo, monkeypatch) -> bool:
    """What ``check_entries`` decides with its quick acceptance turned off."""
    with monkeypatch.context() as m:
        m.setattr(safetensors_index, "_plainly_valid", lambda info: False)
        try:
            check_entries((info,))
        except InvalidHeader:
            return False
    return True


def test_the_quick_acceptance_of_a_claimed_entry_accepts_only_what_the_detailed_checks_accept(monkeypatch) -> None:
    """``_plainly_valid`` skips the detailed checks for plain entries: it must never accept one they refuse (a peer's
    manifest would otherwise carry it past the header parser's rules). Random entries over edge values of every field,
    and every valid one of them is also taken quickly (else the quick path would buy nothing)."""
    rng = random.Random(34)
    accepted = quick = 0
    for _ in range(6000):
        shape = tuple(rng.choice(_DIMS) for _ in range(rng.choice([0, 1, 2, 2, 2, 3, 4, 5])))
        begin = rng.choice(_OFFSETS)
        end = begin + rng.choice(_OFFSETS) if type(begin) is int and rng.random() < 0.7 else rng.choice(_OFFSETS)
        if rng.random() < 0.4 and all(type(d) is int and 0 <= d < 2**20 for d in shape):  # sizes that agree, often
            dtype = rng.choice(["BF16", "F32", "BOOL"])
            end = begin + math.prod(shape) * DTYPE_BITS[dtype] // 8 if type(begin) is int else end
        else:
            dtype = rng.choice(_DTYPES)
        name = "w" if rng.random() < 0.6 else rng.choice(_NAMES)
        info = TensorInfo(name=name, dtype=dtype, shape=shape, begin=begin, end=end)
        fast, detailed = safetensors_index._plainly_valid(info), _detailed(info, monkeypatch)
        assert not fast or detailed, f"the quick check accepted what the detailed checks refuse: {info!r}"
        plain = type(info.name) is str and all(type(d) is int for d in shape) and type(begin) is int and type(end) is int
        if detailed and plain and len(shape) <= 4:
            assert fast, f"a plain valid entry missed the quick path: {info!r}"
        accepted += detailed
        quick += fast
    assert accepted > 250 and quick > 200, (accepted, quick)  # 321 and 275 with this seed


def _header_bytes(entries: list[tuple[str, str]], file_extra: int = 0) -> bytes:
    """A file's first 8 + N bytes from hand-written ``(key, JSON value)`` pairs (duplicates and odd types as written)."""
    text = "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in entries) + "}"
    return struct.pack("<Q", len(text.encode())) + text.encode()


def test_a_header_matched_quickly_against_a_manifest_is_what_the_parser_returns() -> None:
    """``header_matches`` lets a pull's commit skip building the index of the file it wrote: it must never say "the
    same" of a header ``parse_header`` refuses or reads otherwise. Random edits of a valid header (every field's type
    and value, keys missing, extra or written twice, tensors missing, extra or written twice, metadata, the lengths)
    and of the claimed entries; an edit that changes nothing the parser reads (key order, spacing) still matches."""
    rng = random.Random(35)
    claimed = []
    begin = 0
    for i in range(6):
        shape = (1, 8) if i == 0 else (rng.choice([1, 4, 16]), rng.choice([2, 8]))  # t0: a 1 that true equals, at offset 0
        dtype = rng.choice(["BF16", "F32"])
        end = begin + math.prod(shape) * DTYPE_BITS[dtype] // 8
        claimed.append(TensorInfo(name=f"t{i}", dtype=dtype, shape=shape, begin=begin, end=end))
        begin = end
    data_size = begin

    def entry_json(info: TensorInfo, edits: dict[str, str]) -> str:
        fields = {"dtype": json.dumps(info.dtype), "shape": json.dumps(list(info.shape)), "data_offsets": json.dumps([info.begin, info.end])}
        fields.update(edits)
        pairs = [(k, v) for k, v in fields.items() if v is not None]
        rng.shuffle(pairs)
        return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"

    field_edits = {
        "dtype": ['"F16"', '"bf16"', "16", "null", '"BF16"'],
        "shape": ["[1, 2]", "[true, 2]", "[1.0, 2]", "[]", '["1", 2]', "[16, 8, 1]", "[-1, 2]"],
        "data_offsets": ["[0, 8]", "[0]", "[0, 8.0]", "[false, 8]", "[0, 18446744073709551616]"],
        "extra": ["1"],
    }
    matched = refused_or_other = 0
    for _ in range(3000):
        tensors = list(claimed)
        entries = [(t.name, entry_json(t, {})) for t in tensors]
        edit = rng.randrange(12)
        if edit == 0:  # one field of one entry changed; values equal to the right ones in another type, often
            i, key = rng.randrange(len(entries)), rng.choice(list(field_edits))
            info = tensors[i]
            lookalikes = {
                "shape": [json.dumps([float(info.shape[0]), info.shape[1]]), json.dumps([True if info.shape[0] == 1 else info.shape[0], info.shape[1]])],
                "data_offsets": [json.dumps([info.begin, float(info.end)]), json.dumps([False if info.begin == 0 else info.begin, info.end])],
            }.get(key, [])
            entries[i] = (entries[i][0], entry_json(info, {key: rng.choice(field_edits[key] + lookalikes * 2)}))
        elif edit == 1:  # a key of one entry dropped or written twice
            i = rng.randrange(len(entries))
            body = entries[i][1]
            entries[i] = (entries[i][0], body.replace("{", '{"dtype": "F64", ', 1) if rng.random() < 0.5 else body.replace('"shape"', '"shapes"'))
        elif edit == 2:  # a tensor missing, written twice, or one more
            i = rng.randrange(len(entries))
            entries = [e for j, e in enumerate(entries) if j != i] if rng.random() < 0.5 else [*entries, entries[i] if rng.random() < 0.5 else ("extra", entries[i][1])]
        elif edit == 3:  # metadata, valid or not, once or twice
            entries.insert(rng.randrange(len(entries) + 1), ("__metadata__", rng.choice(['{"format": "pt"}', '{"format": 1}', "[]", '{"a": "b", "a": "c"}'])))
            if rng.random() < 0.3:
                entries.append(("__metadata__", '{"format": "pt"}'))
        elif edit == 4:  # a claimed entry that disagrees with itself (its size), the file written to match it
            i = rng.randrange(len(tensors))
            tensors[i] = TensorInfo(tensors[i].name, tensors[i].dtype, (tensors[i].shape[0] + 1, tensors[i].shape[1]), tensors[i].begin, tensors[i].end)
            entries[i] = (tensors[i].name, entry_json(tensors[i], {}))
        elif edit == 5:  # two claimed entries under one name
            tensors[1] = TensorInfo(tensors[0].name, tensors[1].dtype, tensors[1].shape, tensors[1].begin, tensors[1].end)
        rng.shuffle(entries)
        head = _header_bytes(entries)
        size = len(head) + data_size + (rng.choice([-1, 1, 7]) if edit == 6 else 0)
        if edit == 7:  # the length prefix says more or less than the JSON
            head = struct.pack("<Q", len(head) - 8 + rng.choice([-1, 1])) + head[8:]
        fast = safetensors_index.header_matches(head, tuple(tensors), size)
        try:
            parsed = parse_header(head + b"\0" * max(0, size - len(head)), size)
            same = parsed.tensors == tuple(sorted(tensors, key=lambda t: (t.begin, t.end, t.name)))
        except InvalidHeader:
            same = False
        assert not fast or same, f"matched quickly what the parser refuses or reads otherwise (edit {edit}): {head[8:]!r}"
        if edit >= 8:  # nothing changed but key order and spacing: the quick path must take it
            assert fast, head[8:]
        matched += fast
        refused_or_other += not same
    assert matched > 900 and refused_or_other > 900, (matched, refused_or_other)
