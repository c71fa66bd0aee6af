"""adapter_fabric.transport.wire: the hand-written Chunk codec is wire-compatible with the generated class,
rejects malformed bytes with fabric errors only, and plugs into a real grpc.aio server."""

from __future__ import annotations

import os
from typing import Any, AsyncIterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter_fabric.transport import wire
from adapter_fabric.errors import FabricError, IntegrityError, InvalidArgument
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

U64 = (1 << 64) - 1
OFFSETS = [0, 1, 127, 128, 300, 16383, 16384, 1 << 20, (1 << 32) - 1, 1 << 32, 1 << 63, U64]
DATAS = [b"", b"\x00", b"x" * 127, b"y" * 128, os.urandom(1000), os.urandom(1 << 20)]


def generated(offset: int, data: bytes) -> bytes:
    return fabric_pb2.Chunk(offset=offset, data=data).SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


# ------------------------------------------------------------ round trips


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("data", DATAS, ids=lambda d: f"{len(d)}B")
def test_encode_matches_generated_byte_for_byte(offset: int, data: bytes) -> None:
    assert wire.encode_chunk(offset, data) == generated(offset, data)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("data", DATAS, ids=lambda d: f"{len(d)}B")
def test_round_trips_both_ways(offset: int, data: bytes) -> None:
    got_offset, got_data = wire.decode_chunk(generated(offset, data))
    assert (got_offset, bytes(got_data)) == (offset, data)
    parsed = fabric_pb2.Chunk.FromString(wire.encode_chunk(offset, data))
    assert (parsed.offset, parsed.data) == (offset, data)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(0, U64), data=st.binary(max_size=600))
def test_round_trips_property(offset: int, data: bytes) -> None:
    encoded = wire.encode_chunk(offset, data)
    assert encoded == generated(offset, data)
    assert encoded == wire.chunk_header(offset, len(data)) + data
    got_offset, got_data = wire.decode_chunk(encoded)
    assert (got_offset, bytes(got_data)) == (offset, data)


def test_encode_accepts_bytes_like_views() -> None:
    backing = bytearray(os.urandom(4096))
    expected = generated(8192, bytes(backing[1024:3072]))
    assert wire.encode_chunk(8192, memoryview(backing)[1024:3072]) == expected
    assert wire.encode_chunk(8192, bytearray(backing[1024:3072])) == expected
    # A multi-byte item format is sent as its raw bytes, as a bytes field would be.
    ints = memoryview(bytearray(range(16))).cast("I")
    assert wire.encode_chunk(1, ints) == generated(1, bytes(range(16)))


def test_decode_does_not_copy_data() -> None:
    message = generated(4096, b"abcdef" * 1000)
    offset, data = wire.decode_chunk(message)
    assert isinstance(data, memoryview)
    assert data.obj is message  # a view into the message gRPC handed over, not a copy
    assert (offset, bytes(data)) == (4096, b"abcdef" * 1000)


def test_decode_of_empty_message_is_offset_zero_and_no_data() -> None:
    offset, data = wire.decode_chunk(b"")
    assert (offset, bytes(data)) == (0, b"")


def test_decode_skips_unknown_fields_like_generated() -> None:
    unknown = (
        _tag(3, 0) + _varint(U64)  # varint
        + _tag(4, 1) + b"\x01" * 8  # fixed64
        + _tag(5, 2) + _varint(5) + b"hello"  # length-delimited
        + _tag(6, 5) + b"\x02" * 4  # fixed32
        + _tag(7, 3) + _tag(1, 0) + b"\x05" + _tag(8, 2) + b"\x01z" + _tag(7, 4)  # a group, with nesting
        + _tag((1 << 29) - 1, 0) + b"\x00"  # the largest field number
    )
    body = generated(77, b"payload")
    for message in (unknown + body, body + unknown, body[:2] + unknown + body[2:]):
        reference = fabric_pb2.Chunk.FromString(message)
        offset, data = wire.decode_chunk(message)
        assert (offset, bytes(data)) == (reference.offset, reference.data) == (77, b"payload")


def test_decode_any_field_order_and_last_value_wins_like_generated() -> None:
    message = (
        _tag(2, 2) + b"\x03abc" + _tag(1, 0) + _varint(5)
        + _tag(1, 0) + _varint(9) + _tag(2, 2) + b"\x02de"
        # A non-canonical (overlong) varint is still valid protobuf.
        + _tag(1, 0) + b"\x8b\x80\x00"
    )
    reference = fabric_pb2.Chunk.FromString(message)
    offset, data = wire.decode_chunk(message)
    assert (offset, bytes(data)) == (reference.offset, reference.data) == (11, b"de")


# --------------------------------------------------------- malformed input

MALFORMED = {
    "truncated tag": b"\x80",
    "truncated offset varint": b"\x08\x80\x80",
    "offset tag without value": b"\x08",
    "varint longer than 10 bytes": b"\x08" + b"\xff" * 10 + b"\x01",
    "varint above 2**64": b"\x08" + b"\xff" * 9 + b"\x02",
    "data length beyond buffer": b"\x12\x05abc",
    "data length truncated varint": b"\x12\xff",
    "huge data length": b"\x12" + _varint(U64) + b"abc",
    "offset with wire type 2": b"\x0a\x01x",
    "offset with wire type 1": b"\x09" + b"\x00" * 8,
    "data with wire type 0": b"\x10\x01",
    "data with wire type 5": b"\x15abcd",
    "wire type 6": b"\x1e",
    "wire type 7": b"\x1f",
    "field number 0": b"\x00\x01",
    "field number above 2**29-1": _tag(1 << 29, 0) + b"\x00",
    "unknown fixed64 truncated": _tag(9, 1) + b"\x00" * 7,
    "unknown fixed32 truncated": _tag(9, 5) + b"\x00" * 3,
    "unknown bytes beyond buffer": _tag(9, 2) + b"\x09abc",
    "stray end group": _tag(9, 4),
    "unterminated group": _tag(9, 3) + _tag(1, 0) + b"\x01",
    "group closed by another field": _tag(9, 3) + _tag(10, 4),
    "valid chunk then garbage": generated(5, b"abc") + b"\x12\x10",
}


@pytest.mark.parametrize("message", MALFORMED.values(), ids=MALFORMED.keys())
def test_decode_rejects_malformed_with_integrity_error(message: bytes) -> None:
    with pytest.raises(IntegrityError, match="malformed Chunk"):
        wire.decode_chunk(message)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(max_size=40), st.builds(lambda h, t: generated(*h) + t, st.tuples(st.integers(0, U64), st.binary(max_size=8)), st.binary(max_size=8))))
def test_decode_arbitrary_bytes_fabric_errors_only_and_agrees_with_generated(message: bytes) -> None:
    try:
        offset, data = wire.decode_chunk(message)
    except FabricError as exc:
        assert isinstance(exc, IntegrityError)
        return
    # Whatever we accept, the generated parser accepts with the same values.
    reference = fabric_pb2.Chunk.FromString(message)
    assert (offset, bytes(data)) == (reference.offset, reference.data)


@pytest.mark.parametrize("offset", [-1, 1 << 64, 1.0, "1", None, True])
def test_encode_rejects_bad_offsets(offset: Any) -> None:
    with pytest.raises(InvalidArgument, match="chunk offset"):
        wire.encode_chunk(offset, b"x")


@pytest.mark.parametrize("data", ["text", None, 5, [1, 2]])
def test_encode_rejects_non_bytes_data(data: Any) -> None:
    with pytest.raises(InvalidArgument, match="chunk data"):
        wire.encode_chunk(0, data)


def test_encode_rejects_non_contiguous_views_and_oversized_chunks() -> None:
    with pytest.raises(InvalidArgument, match="contiguous"):
        wire.encode_chunk(0, memoryview(b"abcdef")[::2])
    with pytest.raises(InvalidArgument, match="chunk length"):
        wire.chunk_header(0, wire.MAX_MESSAGE_BYTES + 1)


def test_options_set_message_limits_explicitly_on_both_sides() -> None:
    for options in (wire.CHANNEL_OPTIONS, wire.SERVER_OPTIONS):
        as_dict = dict(options)
        assert as_dict["grpc.max_send_message_length"] == wire.MAX_MESSAGE_BYTES
        assert as_dict["grpc.max_receive_message_length"] == wire.MAX_MESSAGE_BYTES
    assert wire.FETCH_CHUNK_SIZE < wire.MAX_MESSAGE_BYTES


# ------------------------------------------------------------ real gRPC

PAYLOAD = os.urandom(3 * 1024 * 1024 + 12345)
SMALL_CHUNK = 256 * 1024


def _ranges(request: fabric_pb2.FetchRequest, chunk: int) -> range:
    end = len(PAYLOAD) if request.length == 0 else min(len(PAYLOAD), request.offset + request.length)
    return range(request.offset, end, chunk)


class WireServicer(fabric_pb2_grpc.FabricServicer):
    """Fetch yields pre-encoded bytes; GetManifest stays on generated code."""

    def __init__(self, chunk: int = SMALL_CHUNK) -> None:
        self.chunk = chunk

    async def Fetch(self, request: fabric_pb2.FetchRequest, context: Any) -> AsyncIterator[bytes]:  # noqa: N802
        view = memoryview(PAYLOAD)
        for offset in _ranges(request, self.chunk):
            yield wire.encode_chunk(offset, view[offset : offset + self.chunk])

    async def GetManifest(self, request: fabric_pb2.GetManifestRequest, context: Any) -> fabric_pb2.Manifest:  # noqa: N802
        return fabric_pb2.Manifest(adapter_id=request.adapter_id, digest="d" * 64, header_size=8)


class GeneratedServicer(fabric_pb2_grpc.FabricServicer):
    """A peer that uses the generated Chunk class (another implementation)."""

    async def Fetch(self, request: fabric_pb2.FetchRequest, context: Any) -> AsyncIterator[fabric_pb2.Chunk]:  # noqa: N802
        for offset in _ranges(request, SMALL_CHUNK):
            yield fabric_pb2.Chunk(offset=offset, data=PAYLOAD[offset : offset + SMALL_CHUNK])


async def _start(servicer: Any, use_wire: bool) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=wire.SERVER_OPTIONS)
    if use_wire:
        wire.add_fabric_servicer_to_server(servicer, server)
    else:
        fabric_pb2_grpc.add_FabricServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _assemble(pieces: list[tuple[int, bytes]], start: int = 0) -> bytes:
    expected = start
    for offset, data in pieces:
        assert offset == expected, "chunks arrive in order, contiguous"
        expected += len(data)
    return b"".join(data for _, data in pieces)


async def test_wire_server_generated_client_decodes_hand_encoded_chunks() -> None:
    server, address = await _start(WireServicer(), use_wire=True)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            stub = fabric_pb2_grpc.FabricStub(channel)
            pieces = [(c.offset, c.data) async for c in stub.Fetch(fabric_pb2.FetchRequest(digest="x"))]
            assert _assemble(pieces) == PAYLOAD
            # A range starting mid-file, as a resume does.
            request = fabric_pb2.FetchRequest(digest="x", offset=SMALL_CHUNK * 2, length=SMALL_CHUNK * 3)
            pieces = [(c.offset, c.data) async for c in stub.Fetch(request)]
            assert _assemble(pieces, SMALL_CHUNK * 2) == PAYLOAD[SMALL_CHUNK * 2 : SMALL_CHUNK * 5]
            # The rest of the service is untouched generated code.
            manifest = await stub.GetManifest(fabric_pb2.GetManifestRequest(adapter_id="team-a/x"))
            assert (manifest.adapter_id, manifest.header_size) == ("team-a/x", 8)
    finally:
        await server.stop(None)


async def test_wire_server_wire_client() -> None:
    server, address = await _start(WireServicer(), use_wire=True)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            pieces = [(o, bytes(d)) async for o, d in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x"))]
            assert _assemble(pieces) == PAYLOAD
    finally:
        await server.stop(None)


async def test_generated_server_wire_client() -> None:
    server, address = await _start(GeneratedServicer(), use_wire=False)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            pieces = [(o, bytes(d)) async for o, d in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x"))]
            assert _assemble(pieces) == PAYLOAD
    finally:
        await server.stop(None)


async def test_tuned_options_carry_chunks_above_grpc_default_4mib_limit() -> None:
    server, address = await _start(WireServicer(chunk=5 * 1024 * 1024), use_wire=True)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            pieces = [(o, bytes(d)) async for o, d in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x"))]
            assert [len(d) for _, d in pieces] == [len(PAYLOAD)]
            assert _assemble(pieces) == PAYLOAD
    finally:
        await server.stop(None)


class BrokenServicer(WireServicer):
    """Sends one good chunk, then one that claims 5 bytes and carries 3."""

    async def Fetch(self, request: Any, context: Any) -> AsyncIterator[bytes]:  # noqa: N802
        yield wire.encode_chunk(0, b"good")
        yield b"\x08\x04\x12\x05abc"


async def test_malformed_chunk_from_peer_raises_integrity_error_not_a_short_stream() -> None:
    server, address = await _start(BrokenServicer(), use_wire=True)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            got = []
            # grpc.aio alone would hand the caller None for the bad message.
            with pytest.raises(IntegrityError, match="data claims 5 bytes, 3 left"):
                async for offset, data in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x")):
                    got.append((offset, bytes(data)))
            assert got == [(0, b"good")]
    finally:
        await server.stop(None)


async def test_leaving_a_fetch_early_cancels_it_and_the_channel_stays_usable() -> None:
    server, address = await _start(WireServicer(), use_wire=True)
    try:
        async with grpc.aio.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
            fetch = wire.fetch_stub(channel)
            stream = fetch(fabric_pb2.FetchRequest(digest="x"))
            offset, _ = await stream.__anext__()
            assert offset == 0
            await stream.aclose()
            pieces = [(o, bytes(d)) async for o, d in fetch(fabric_pb2.FetchRequest(digest="x"))]
            assert _assemble(pieces) == PAYLOAD
    finally:
        await server.stop(None)


async def test_generic_fetch_handler_beside_generated_registration_is_not_used() -> None:
    """Why add_fabric_servicer_to_server exists: registered handlers win over generic ones."""
    server = grpc.aio.server(options=wire.SERVER_OPTIONS)
    servicer = WireServicer()
    fetch_only = grpc.method_handlers_generic_handler("fabric.v1.Fabric", {"Fetch": wire.fetch_method_handler(servicer.Fetch)})
    server.add_generic_rpc_handlers((fetch_only,))
    fabric_pb2_grpc.add_FabricServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                # The generated serializer gets our bytes and fails.
                [m async for m in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x"))]
    finally:
        await server.stop(None)


def test_fabric_method_handlers_cover_the_whole_service() -> None:
    handlers = wire.fabric_method_handlers(WireServicer())
    service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]
    assert set(handlers) == {method.name for method in service.methods}
    assert handlers["Fetch"].response_serializer is None
    assert handlers["GetManifest"].response_serializer is not None


def test_sync_server_and_channel_also_work() -> None:
    from concurrent import futures

    class SyncServicer(fabric_pb2_grpc.FabricServicer):
        def Fetch(self, request: Any, context: Any) -> Any:  # noqa: N802
            if request.file == "broken":
                yield b"\x12\x05abc"
                return
            for offset in _ranges(request, SMALL_CHUNK):
                yield wire.encode_chunk(offset, PAYLOAD[offset : offset + SMALL_CHUNK])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=wire.SERVER_OPTIONS)
    wire.add_fabric_servicer_to_server(SyncServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS) as channel:
            pieces = [(o, bytes(d)) for o, d in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="x"))]
            assert _assemble(pieces) == PAYLOAD
            pieces = [(c.offset, c.data) for c in fabric_pb2_grpc.FabricStub(channel).Fetch(fabric_pb2.FetchRequest())]
            assert _assemble(pieces) == PAYLOAD
            with pytest.raises(IntegrityError, match="data claims 5 bytes"):
                list(wire.fetch_stub(channel)(fabric_pb2.FetchRequest(file="broken")))
    finally:
        server.stop(None)


def test_fetch_metadata_holder_hints_parse_bounded_and_refuse_junk() -> None:
    """What a pulling peer says it holds rides on its Fetch request; junk is ignored (a hint is advisory), never raised."""
    from adapter_fabric.transport import fetch_metadata

    sent = fetch_metadata.holder(50051, b"\x05")
    assert fetch_metadata.holder_of(sent, "ipv4:10.0.0.7:41234") == ("10.0.0.7", 50051, b"\x05")
    assert fetch_metadata.holder_of(sent, "ipv6:[::1]:41234") == ("::1", 50051, b"\x05")
    for metadata, peer in [
        ((), "ipv4:10.0.0.7:1"),
        (((fetch_metadata.HOLDER_PORT_KEY, "70000"), (fetch_metadata.HOLDER_BITMAP_KEY, b"\x01")), "ipv4:10.0.0.7:1"),
        (((fetch_metadata.HOLDER_PORT_KEY, "-1"), (fetch_metadata.HOLDER_BITMAP_KEY, b"\x01")), "ipv4:10.0.0.7:1"),
        (((fetch_metadata.HOLDER_PORT_KEY, "50051"),), "ipv4:10.0.0.7:1"),
        (sent, "unix:/tmp/sock"),
    ]:
        assert fetch_metadata.holder_of(metadata, peer) is None
    assert fetch_metadata.holding(fetch_metadata.verified(b"\x03")) == (b"\x03", False)
    assert fetch_metadata.holding(fetch_metadata.complete()) == (None, True)
    assert fetch_metadata.picked_chunks(fetch_metadata.picked([3, 1])) == [3, 1]


class _SchemeOneNode(fabric_pb2_grpc.FabricServicer):
    """Answers UploadOffset the way a node of digest scheme 1 does: no chunk size, no scheme."""

    async def UploadOffset(self, request, context):
        return fabric_pb2.UploadOffsetResponse(offset=0)


async def test_a_client_meeting_a_node_of_digest_scheme_1_says_so_before_sending_a_byte(tmp_path) -> None:
    import asyncio

    from adapter_fabric.client.node_client import NodeClient
    from adapter_fabric.errors import IncompatibleFormat
    from adapter_fabric.serving.tiny import make_peft_adapter

    adapter = make_peft_adapter(tmp_path / "a", r=2)
    server, address = await _start(_SchemeOneNode(), use_wire=False)
    try:
        def stage() -> None:
            with NodeClient(address) as client:
                client.stage(adapter, "old/node")

        with pytest.raises(IncompatibleFormat, match=r"node 127\.0\.0\.1:\d+ uses digest scheme 1 .*scheme 2"):
            await asyncio.to_thread(stage)
    finally:
        await server.stop(None)


def test_the_hand_named_rpc_paths_are_the_generated_services() -> None:
    """Fetch's and Availability's callables are made by path, not through ``FabricStub`` (one callable per RPC of the
    service, made per call): the paths must be the service's own."""
    from adapter_fabric.rpc.limits import FETCH_METHOD as LIMITED_FETCH
    from adapter_fabric.transport import peer_calls, wire
    from adapter_fabric.v1 import fabric_pb2

    service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]
    path = {name: f"/{service.full_name}/{name}" for name in service.methods_by_name}
    assert wire.FETCH_METHOD == LIMITED_FETCH == path["Fetch"]
    assert peer_calls.AVAILABILITY_METHOD == path["Availability"]
