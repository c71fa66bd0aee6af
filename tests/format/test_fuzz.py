"""Property-based fuzzing of the parsers that read bytes from peers and clients.

For any input, ``safetensors_index.parse_header``, ``wire.decode_chunk`` and
``Manifest.from_proto`` either return or raise a ``adapter_fabric.errors.FabricError``
subclass: never a ``KeyError``, ``RecursionError``, ``OverflowError`` or
``MemoryError``. Inputs that claim huge sizes (a 2**63-byte header, a tensor of
2**64 elements, a chunk of 2**63 bytes) must not make the parser allocate what
they claim: tracemalloc's peak stays under a bound. The hypothesis deadline and
pytest-timeout catch a hang; example counts are kept modest for CI.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter_fabric.transport import wire
from adapter_fabric.errors import FabricError
from adapter_fabric.store.manifest import Manifest, build_manifest
from adapter_fabric.format.safetensors_index import DTYPE_BITS, MAX_HEADER_BYTES, parse_header
from adapter_fabric.v1 import fabric_pb2

pytestmark = pytest.mark.timeout(120)

U64 = 2**64 - 1
# Generous: two shared cores; a hang is minutes, a slow example well under a second.
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=3), suppress_health_check=[HealthCheck.too_slow])
MEMORY_BOUND = 4 << 20  # bytes of peak Python allocation per parse of a small hostile input


def only_fabric_errors(fn, *args, **kwargs):
    """Call ``fn``; a FabricError is a fine answer, anything else fails the property."""
    try:
        return fn(*args, **kwargs)
    except FabricError:
        return None


def peak_bytes(fn, *args, **kwargs) -> int:
    tracemalloc.start()
    try:
        only_fabric_errors(fn, *args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- safetensors headers

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12))
json_values = st.recursive(
    json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12
)
dims = st.one_of(st.integers(0, 70), st.integers(-3, 2**66), st.sampled_from([2**32, 2**63, U64, U64 + 1]))
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BITS)), st.text(max_size=6), json_scalars),
        "shape": st.one_of(st.lists(dims, max_size=5), json_values),
        "data_offsets": st.one_of(st.lists(st.one_of(st.integers(-5, 5000), st.sampled_from([U64, U64 + 1, 2**63])), max_size=3), json_values),
        "extra": json_scalars,
    },
)
metadata = st.one_of(st.dictionaries(st.text(max_size=6), st.one_of(st.text(max_size=6), json_scalars), max_size=3), json_values)
headers = st.dictionaries(
    st.one_of(st.text(max_size=10), st.just("__metadata__")), st.one_of(entries, metadata, json_values), max_size=5
)


def framed(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


@FUZZ
@given(st.binary(max_size=2048), st.one_of(st.none(), st.integers(0, 2**70)))
def test_parse_header_raw_bytes(data: bytes, file_size: int | None) -> None:
    only_fabric_errors(parse_header, data, file_size)


@FUZZ
@given(headers, st.binary(max_size=256), st.one_of(st.none(), st.integers(0, U64)), st.booleans())
def test_parse_header_structured(header: dict, data: bytes, length: int | None, with_size: bool) -> None:
    encoded = json.dumps(header).encode()
    raw = framed(encoded, data, length)
    index = only_fabric_errors(parse_header, raw, len(raw) if with_size else None)
    if index is not None:  # accepted: then it really is consistent
        assert index.header_size == (len(encoded) if length is None else length)
        if with_size:
            assert index.file_size == len(raw)
        expected = 0
        for tensor in index.tensors:
            assert tensor.begin == expected and tensor.end >= tensor.begin
            expected = tensor.end


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**64 - 1))
def test_parse_header_claimed_length_costs_no_memory(tail: bytes, claimed: int) -> None:
    """A header length of up to 2**64 over a few bytes allocates nothing of that size."""
    assert peak_bytes(parse_header, framed(b"{" + tail, length=claimed)) < MEMORY_BOUND


@FUZZ
@given(st.lists(st.sampled_from([2**20, 2**32, 2**63, U64]), min_size=1, max_size=6), st.sampled_from(sorted(DTYPE_BITS)))
def test_parse_header_huge_shape_costs_no_memory(shape: list[int], dtype: str) -> None:
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, 8]}}).encode()
    assert peak_bytes(parse_header, framed(header, b"\0" * 8)) < MEMORY_BOUND


@settings(max_examples=20, deadline=timedelta(seconds=10))
@given(st.sampled_from(["[", "{\"a\":", "[{\"a\":"]), st.integers(1_000, 200_000))
def test_parse_header_deep_nesting(opener: str, depth: int) -> None:
    """Nesting 200 000 deep is an InvalidHeader, not a RecursionError."""
    with pytest.raises(FabricError):
        parse_header(framed((opener * depth).encode()))


def test_parse_header_refuses_the_limit_plus_one_without_reading() -> None:
    assert peak_bytes(parse_header, framed(b"{}", length=MAX_HEADER_BYTES + 1)) < MEMORY_BOUND


# ---------------------------------------------------------------- Fetch chunks


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


fields = st.one_of(
    st.builds(lambda v: b"\x08" + varint(v), st.integers(0, 2**70)),  # offset (maybe too big)
    st.builds(lambda n, d: b"\x12" + varint(n) + d, st.integers(0, 2**64), st.binary(max_size=32)),  # data, length maybe a lie
    st.builds(lambda f, t: varint((f << 3) | t), st.integers(0, 2**30), st.integers(0, 7)),  # any tag
    st.builds(lambda n: b"\x1b" * n, st.integers(1, 5000)),  # groups nested n deep
    st.binary(max_size=16),
)


@FUZZ
@given(st.binary(max_size=4096))
def test_decode_chunk_raw_bytes(buf: bytes) -> None:
    only_fabric_errors(wire.decode_chunk, buf)


@FUZZ
@given(st.lists(fields, max_size=8))
def test_decode_chunk_structured(parts: list[bytes]) -> None:
    buf = b"".join(parts)
    decoded = only_fabric_errors(wire.decode_chunk, buf)
    if decoded is not None:
        offset, data = decoded
        assert 0 <= offset <= U64 and data.nbytes <= len(buf)


@FUZZ
@given(st.integers(0, U64), st.binary(max_size=512), st.integers(0, 600), st.integers(0, 255))
def test_decode_chunk_of_a_damaged_chunk(offset: int, data: bytes, where: int, value: int) -> None:
    """One byte of a valid chunk changed, or the chunk cut short: decoded or IntegrityError."""
    good = wire.encode_chunk(offset, data)
    assert (lambda got: (got[0], bytes(got[1])))(wire.decode_chunk(good)) == (offset, data)
    damaged = bytearray(good)
    if damaged:
        damaged[where % len(damaged)] = value
    only_fabric_errors(wire.decode_chunk, bytes(damaged))
    only_fabric_errors(wire.decode_chunk, good[: where % (len(good) + 1)])


@FUZZ
@given(st.integers(2**20, 2**64))
def test_decode_chunk_claimed_length_costs_no_memory(claimed: int) -> None:
    assert peak_bytes(wire.decode_chunk, b"\x12" + varint(claimed) + b"x" * 16) < MEMORY_BOUND


def test_decode_chunk_deep_groups_are_refused() -> None:
    with pytest.raises(FabricError, match="nested"):
        wire.decode_chunk(b"\x1b" * 100_000)


# ---------------------------------------------------------------- manifests from peers


@pytest.fixture(scope="module")
def manifest_proto(tmp_path_factory) -> bytes:
    from adapter_fabric.serving.tiny import make_peft_adapter

    adapter = make_peft_adapter(tmp_path_factory.mktemp("fuzz") / "a", r=4)
    return build_manifest("fuzz/a", (adapter / "adapter_config.json").read_bytes(), adapter / "adapter_model.safetensors", 4096).to_proto().SerializeToString()


mutations = st.lists(
    st.one_of(
        st.tuples(st.just("size"), st.integers(0, U64)),
        st.tuples(st.just("chunk_size"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("root"), st.text(max_size=70)),
        st.tuples(st.just("digest_scheme"), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("chunks"), st.lists(st.binary(max_size=40), max_size=5)),
        st.tuples(st.just("header_size"), st.integers(0, U64)),
        st.tuples(st.just("content_id"), st.integers(0, U64)),
        st.tuples(st.just("digest"), st.text(max_size=70)),
        st.tuples(st.just("adapter_id"), st.text(max_size=140)),
        st.tuples(st.just("config_json"), st.binary(max_size=200)),
        st.tuples(st.just("shape"), st.lists(st.integers(0, U64), max_size=4)),
        st.tuples(st.just("offsets"), st.tuples(st.integers(0, U64), st.integers(0, U64))),
        st.tuples(st.just("dtype"), st.text(max_size=8)),
        st.tuples(st.just("drop_tensor"), st.integers(0, 10)),
    ),
    min_size=1,
    max_size=3,
)


def mutate(pb: fabric_pb2.Manifest, kind: str, value) -> None:
    weights = pb.files[1]
    tensor = pb.tensors[0] if pb.tensors else None
    if kind in ("size", "chunk_size", "root"):
        setattr(weights, kind, value)
    elif kind == "chunks":
        weights.chunk_digests[:] = value
    elif kind in ("header_size", "content_id", "digest", "adapter_id", "config_json", "digest_scheme"):
        setattr(pb, kind, value)
    elif kind == "shape" and tensor is not None:
        tensor.shape[:] = value
    elif kind == "offsets" and tensor is not None:
        tensor.begin, tensor.end = value
    elif kind == "dtype" and tensor is not None:
        tensor.dtype = value
    elif kind == "drop_tensor" and pb.tensors:
        del pb.tensors[value % len(pb.tensors)]


@FUZZ
@given(mutations)
def test_manifest_from_proto_mutated(manifest_proto: bytes, changes: list) -> None:
    pb = fabric_pb2.Manifest.FromString(manifest_proto)
    for kind, value in changes:
        mutate(pb, kind, value)
    assert peak_bytes(Manifest.from_proto, pb) < MEMORY_BOUND
