"""Read and validate a safetensors header from bytes, without loading a tensor.

A safetensors file is ``N`` (8 bytes, little-endian u64), ``N`` bytes of UTF-8
JSON, then the data section. The JSON maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
data section) plus an optional ``__metadata__`` string-to-string object.

The checks follow the Rust ``safetensors`` 0.8 reader (dtype list, header size
limit, contiguous offsets, exact file length) and add what it does not catch:
duplicate names or keys (``json.loads`` would silently keep the last one) and
extra keys in a tensor entry. A header from a peer can be checked before a
single data byte arrives: ``header_length`` on the first 8 bytes, then
``parse_header`` on the first ``8 + N``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from adapter_fabric.errors import InvalidHeader

MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
_U64_MAX = 2**64 - 1
_ENTRY_KEYS = ("data_offsets", "dtype", "shape")

#: Bits per element of every dtype safetensors 0.8 knows (F4 and F6 are packed sub-byte types).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
#: Bytes per element of every whole-byte dtype (the sub-byte F4/F6 types have no per-element byte size).
DTYPE_SIZES: dict[str, int] = {name: bits // 8 for name, bits in DTYPE_BITS.items() if bits % 8 == 0}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class SafetensorsIndex:
    header_size: int  # N, the JSON length
    tensors: tuple[TensorInfo, ...]  # sorted by begin
    metadata: dict[str, str]
    _by_name: dict[str, TensorInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    @property
    def data_offset(self) -> int:
        return 8 + self.header_size

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        return 8 + self.header_size + self.data_size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            shown = ", ".join(sorted(self._by_name)[:5])
            more = f" (+{len(self._by_name) - 5} more)" if len(self._by_name) > 5 else ""
            raise InvalidHeader(
                f"tensor {name!r} is not in the header; it holds {len(self._by_name)} tensors: {shown}{more}"
            ) from None


# ---------------------------------------------------------------- public API


def header_length(prefix: bytes | bytearray | memoryview, *, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """``N`` from the first 8 bytes of a safetensors file, checked against the limit."""
    if len(prefix) < 8:
        raise InvalidHeader(f"a safetensors file starts with an 8-byte header length; got only {len(prefix)} bytes")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n == 0:
        raise InvalidHeader("header length is 0: a safetensors header holds at least '{}'")
    if n > max_header_bytes:
        raise InvalidHeader(f"header length {n} bytes exceeds the limit of {max_header_bytes} bytes")
    return n


def parse_header(
    data: bytes | bytearray | memoryview, file_size: int | None = None, *, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsIndex:
    """Validate the header in ``data`` (at least the first ``8 + N`` bytes of the file).

    With ``file_size``, the file must be exactly ``8 + N + last end`` bytes long.
    """
    n = header_length(data, max_header_bytes=max_header_bytes)
    if len(data) < 8 + n:
        raise InvalidHeader(f"truncated header: the length says {n} bytes but only {len(data) - 8} follow it")
    raw = _decode_json(bytes(data[8 : 8 + n]))
    metadata, entries = _split_top_level(raw)
    tensors = tuple(sorted((_tensor_info(name, value) for name, value in entries), key=lambda t: (t.begin, t.end, t.name)))
    _check_contiguous(tensors)
    index = SafetensorsIndex(header_size=n, tensors=tensors, metadata=metadata)
    if file_size is not None:
        _check_file_size(index, file_size)
    return index


def check_entries(tensors: tuple[TensorInfo, ...]) -> None:
    """Entries claimed elsewhere (a manifest's tensor index) held to ``parse_header``'s checks of each entry, without a
    JSON round trip: a string name that is not ``__metadata__``, a known dtype, integer shape and offsets that agree.

    An entry that passes one expression of strict checks (plain ints, at most four dimensions) is accepted as it is; only
    the others go through the checks that name what is wrong (~1 ms of each pull of a 448-tensor adapter)."""
    for info in tensors:
        if _plainly_valid(info):
            continue
        name = info.name
        if not isinstance(name, str) or name == METADATA_KEY:
            raise InvalidHeader(f"{name!r} is not a tensor name")
        dtype = _parse_dtype(name, info.dtype)
        shape = _parse_shape(name, list(info.shape) if isinstance(info.shape, tuple) else info.shape)
        begin, end = _parse_offsets(name, [info.begin, info.end])
        _check_byte_size(name, dtype, shape, end - begin)


def _plainly_valid(info: TensorInfo) -> bool:
    """A subset of what ``check_entries``' detailed checks accept: built-in str and int only (no bool, no subclass), a
    shape of at most four dimensions below 2**64 whose elements fill the offsets' span exactly."""
    name, dtype, shape, begin, end = info.name, info.dtype, info.shape, info.begin, info.end
    if type(name) is not str or name == METADATA_KEY or type(dtype) is not str or type(shape) is not tuple or len(shape) > 4:
        return False
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= _U64_MAX:
        return False
    bits = DTYPE_BITS.get(dtype, 0)
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= _U64_MAX:
            return False
        bits *= dim
    return dtype in DTYPE_BITS and bits == (end - begin) * 8


def header_matches(data: bytes | bytearray | memoryview, tensors: tuple[TensorInfo, ...], file_size: int) -> bool:
    """Whether ``parse_header`` would accept the header in ``data`` (a file's first ``8 + N`` of ``file_size`` bytes) and
    return ``tensors``, found without building the index (1.3 against 2.3 ms for 448 tensors, at a pull's commit).
    False says only "parse it": ``parse_header`` then names what is wrong, or the caller what differs."""
    try:
        n = header_length(data)
        if len(data) < 8 + n or not all(_plainly_valid(t) for t in tensors):
            return False
        check_layout(tuple(sorted(tensors, key=lambda t: (t.begin, t.end, t.name))))
        raw = _decode_json(bytes(data[8 : 8 + n]))
        expected = {t.name: t for t in tensors}
        metadata = 0
        for name, value in raw:
            info = expected.pop(name, None)  # popped: a name written twice finds nothing the second time
            if name == METADATA_KEY:
                metadata += 1
                _parse_metadata(value)  # its refusal is a mismatch
            elif info is None or not _entry_is(value, info):
                return False
    except InvalidHeader:
        return False
    data_size = max((t.end for t in tensors), default=0)
    return metadata <= 1 and not expected and len(tensors) == len({t.name for t in tensors}) and file_size == 8 + n + data_size


def _entry_is(value: Any, info: TensorInfo) -> bool:
    """A decoded tensor entry is ``info``'s, in built-in types only (no bool for an int, no float)."""
    if type(value) is not _Pairs or len(value) != 3:
        return False
    entry = dict(value)  # three pairs, and each of the three keys found: no key missing, extra or written twice
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    return (
        type(dtype) is str and dtype == info.dtype
        and type(shape) is list and all(type(d) is int for d in shape) and tuple(shape) == info.shape
        and type(offsets) is list and len(offsets) == 2 and all(type(o) is int for o in offsets) and offsets == [info.begin, info.end]
    )  # fmt: skip


def check_layout(tensors: tuple[TensorInfo, ...]) -> None:
    """Entries in offset order lie end to end from the data section's start (``parse_header``'s layout check)."""
    _check_contiguous(tensors)


def read_index(path: str | os.PathLike[str], *, max_header_bytes: int = MAX_HEADER_BYTES, name: str = "") -> SafetensorsIndex:
    """The index of a safetensors file, reading only its ``8 + N`` header bytes.

    A refusal starts with ``name`` (a node passes the adapter's id: its own paths are no caller's business), else the path.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        try:
            prefix = f.read(8)
            n = header_length(prefix, max_header_bytes=max_header_bytes)
            if file_size < 8 + n:
                raise InvalidHeader(f"truncated header: the length says {n} bytes but the file has only {file_size - 8} after it")
            return parse_header(prefix + f.read(n), file_size, max_header_bytes=max_header_bytes)
        except InvalidHeader as exc:
            raise InvalidHeader(f"{name or os.fspath(path)}: {exc}") from None


# ---------------------------------------------------------------- JSON


class _Pairs(list):
    """A JSON object kept as its list of pairs, so duplicate keys stay visible."""


def _decode_json(header: bytes) -> _Pairs:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidHeader(f"header is not valid UTF-8 (byte {exc.start} of {len(header)})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        raise InvalidHeader(f"header is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer with too many digits, or absurd nesting
        raise InvalidHeader(f"header is not acceptable JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(raw, _Pairs):
        raise InvalidHeader(f"header JSON must be an object, not {_json_type(raw)}")
    return raw


def _json_type(value: Any) -> str:
    if isinstance(value, _Pairs):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string"


def _unique(pairs: _Pairs, what: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidHeader(f"duplicate {what} {key!r}: JSON readers would silently keep only the last one")
        seen[key] = value
    return seen


def _split_top_level(raw: _Pairs) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    if sum(key == METADATA_KEY for key, _ in raw) > 1:
        raise InvalidHeader(f"duplicate {METADATA_KEY}: JSON readers would silently keep only the last one")
    top = _unique(raw, "tensor name")
    metadata = _parse_metadata(top.pop(METADATA_KEY)) if METADATA_KEY in top else {}
    return metadata, list(top.items())


def _parse_metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, _Pairs):
        raise InvalidHeader(f"{METADATA_KEY} must be an object mapping strings to strings, not {_json_type(value)}")
    metadata = _unique(value, f"{METADATA_KEY} key")
    for key, item in metadata.items():
        if not isinstance(item, str):
            raise InvalidHeader(f"{METADATA_KEY}[{key!r}] must be a string, not {_json_type(item)}")
    return metadata


# ---------------------------------------------------------------- tensor entries


def _tensor_info(name: str, value: Any) -> TensorInfo:
    if not isinstance(value, _Pairs):
        raise InvalidHeader(f"tensor {name!r}: entry must be an object with dtype, shape, data_offsets, not {_json_type(value)}")
    entry = _unique(value, f"key in tensor {name!r}:")
    keys = sorted(entry)
    if keys != list(_ENTRY_KEYS):
        missing = sorted(set(_ENTRY_KEYS) - set(keys))
        extra = sorted(set(keys) - set(_ENTRY_KEYS))
        raise InvalidHeader(
            f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets (missing {missing}, extra {extra})"
        )
    dtype = _parse_dtype(name, entry["dtype"])
    shape = _parse_shape(name, entry["shape"])
    begin, end = _parse_offsets(name, entry["data_offsets"])
    _check_byte_size(name, dtype, shape, end - begin)
    return TensorInfo(name=name, dtype=dtype, shape=shape, begin=begin, end=end)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_dtype(name: str, dtype: Any) -> str:
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise InvalidHeader(f"tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    return dtype


def _parse_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list):
        raise InvalidHeader(f"tensor {name!r}: shape must be a list of non-negative integers, not {_json_type(shape)}")
    for axis, dim in enumerate(shape):
        if not _is_int(dim) or not 0 <= dim <= _U64_MAX:
            raise InvalidHeader(
                f"tensor {name!r}: shape[{axis}]={dim!r} must be a non-negative integer below 2**64 (shape {shape!r})"
            )
    return tuple(shape)


def _parse_offsets(name: str, offsets: Any) -> tuple[int, int]:
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(v) for v in offsets):
        raise InvalidHeader(f"tensor {name!r}: data_offsets={offsets!r} must be a pair of integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= _U64_MAX:
        raise InvalidHeader(f"tensor {name!r}: data_offsets=[{begin}, {end}] must satisfy 0 <= begin <= end < 2**64")
    return begin, end


def _check_byte_size(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    # Multiply step by step and stop once past the declared span: a hostile shape
    # costs no more than the offsets (already bounded by the file) allow.
    limit = nbytes * 8
    bits = 0 if 0 in shape else DTYPE_BITS[dtype]
    for dim in shape if bits else ():
        bits *= dim
        if bits > limit:
            raise InvalidHeader(
                f"tensor {name!r}: shape {list(shape)} of {dtype} needs more than the {nbytes} bytes "
                f"its data_offsets span (end - begin)"
            )
    if bits % 8:
        raise InvalidHeader(f"tensor {name!r}: shape {list(shape)} of {dtype} is {bits} bits, not a whole number of bytes")
    if bits // 8 != nbytes:
        raise InvalidHeader(
            f"tensor {name!r}: shape {list(shape)} of {dtype} is {bits // 8} bytes but data_offsets span "
            f"{nbytes} bytes (end - begin)"
        )


# ---------------------------------------------------------------- layout


def _check_contiguous(tensors: tuple[TensorInfo, ...]) -> None:
    """Sorted by begin, each tensor starts where the previous one ended, the first at 0."""
    expected, previous = 0, None
    previous_name = ""
    for info in tensors:
        if info.begin > expected:
            after = f"after tensor {previous.name!r} ends" if previous else "at the start of the data section"
            raise InvalidHeader(
                f"tensor {info.name!r}: data_offsets begin {info.begin} leaves a gap of {info.begin - expected} "
                f"bytes {after} (at {expected}); tensors must be contiguous"
            )
        if info.begin < expected:
            raise InvalidHeader(
                f"tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] overlap tensor {previous_name!r} "
                f"which ends at {expected}"
            )
        expected, previous = info.end, info
        previous_name = info.name


def _check_file_size(index: SafetensorsIndex, file_size: int) -> None:
    expected = index.file_size
    if file_size < expected:
        raise InvalidHeader(
            f"file is short: 8 + header {index.header_size} + data {index.data_size} = {expected} bytes expected, "
            f"file has {file_size} ({expected - file_size} missing)"
        )
    if file_size > expected:
        raise InvalidHeader(
            f"file has {file_size - expected} trailing bytes after the last tensor: 8 + header {index.header_size} "
            f"+ data {index.data_size} = {expected} bytes expected, file has {file_size}"
        )

