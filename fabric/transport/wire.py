"""The hot path for chunk bytes over gRPC: a hand-written ``fabric.v1.Chunk`` codec,
measured channel/server options, and a raw-bytes ``Fetch`` handler and stub.

Why: the generated ``Chunk`` class copies its ``bytes`` field on every parse and
serialize. Here a chunk is encoded with one copy (header + data joined into the
message bytes that gRPC sends) and decoded with none (``data`` is a memoryview
into the message bytes gRPC hands us). The encoding is byte-for-byte the one
``fabric_pb2.Chunk.SerializeToString`` produces, so peers written in any
language, or using the generated stubs, interoperate. Figures and what each
piece buys: docs/BENCHMARKS.md, "Transfer" (scripts/bench_transfer.py).

Wire format of ``message Chunk { uint64 offset = 1; bytes data = 2; }`` (proto3,
defaults omitted):  ``0x08 varint(offset)`` when offset != 0, then
``0x12 varint(len(data)) data`` when data is not empty.

Server side (grpc.aio), registering the whole ``Fabric`` service with the
generated code except ``Fetch``::

    wire.tune_malloc()                                     # once, at process start
    server = grpc.aio.server(options=wire.SERVER_OPTIONS)
    wire.add_fabric_servicer_to_server(servicer, server)   # instead of add_FabricServicer_to_server
    # servicer.Fetch(request: FetchRequest, context) is an async generator that
    # yields wire.encode_chunk(offset, data): ``bytes`` (gRPC refuses bytearray
    # and memoryview here), not Chunk messages. Every other method is unchanged.

Do NOT instead add a generic handler for Fetch next to
``add_FabricServicer_to_server``: the generated function also registers every
method as a *registered* method, and registered handlers take precedence over
generic ones, whatever the order (see tests/transport/test_wire.py).

Client side::

    channel = grpc.aio.insecure_channel(peer, options=wire.CHANNEL_OPTIONS)
    fetch = wire.fetch_stub(channel)
    async for offset, data in fetch(FetchRequest(digest=..., offset=...), timeout=...):
        ...   # data: memoryview into the received message, valid while you hold it

Errors: a malformed chunk on the wire raises ``IntegrityError`` from the stub
(the bytes a peer sent are not a valid Chunk: drop the stream, resume
elsewhere); bad arguments to the encoder raise ``InvalidArgument``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from adapter_fabric.errors import IntegrityError, InvalidArgument
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

__all__ = [
    "FETCH_CHUNK_SIZE",
    "MAX_MESSAGE_BYTES",
    "FETCH_METHOD",
    "CHANNEL_OPTIONS",
    "SERVER_OPTIONS",
    "chunk_header",
    "encode_chunk",
    "decode_chunk",
    "fetch_method_handler",
    "fetch_stub",
    "fabric_method_handlers",
    "add_fabric_servicer_to_server",
    "tune_malloc",
]

#: Bytes of file data per Fetch message (and the suggested manifest chunk size).
#: 1 MiB measured fastest of 256 KiB / 1 / 2 / 4 MiB (docs/BENCHMARKS.md,
#: "Transfer"), and is a fine grain for per-chunk sha256 and resume.
FETCH_CHUNK_SIZE = 1 << 20

#: Message size limit set explicitly on both sides, far above FETCH_CHUNK_SIZE
#: so a manifest with many chunk digests, or a peer with a larger chunk size, fits.
MAX_MESSAGE_BYTES = 64 << 20

FETCH_METHOD = "/fabric.v1.Fabric/Fetch"


_U64_MAX = (1 << 64) - 1
_MAX_FIELD = (1 << 29) - 1  # protobuf's largest field number
_TAG_OFFSET = 0x08  # field 1, wire type 0 (varint)
_TAG_DATA = 0x12  # field 2, wire type 2 (length-delimited)
_MAX_GROUP_DEPTH = 100  # protobuf's own default recursion limit; deeper nesting is refused, not recursed into

# Measured with `bench_transfer.py --sweep-options` (docs/BENCHMARKS.md): on
# loopback only the explicit message limits helped; a fixed 16 MiB HTTP/2 window
# (lookahead_bytes, BDP probe off) was slower, 1-4 MiB windows, 16 MiB frames and
# an 8 MiB write buffer no better. The BDP estimator stays on (the default, set
# explicitly) so windows grow to a real network's bandwidth-delay product by
# themselves. What did help is tune_malloc() below.
_COMMON_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 1),
)

#: Options for every channel to a peer (``grpc.aio.insecure_channel(addr, options=...)``). A channel that could not
#: connect retries after a backoff that grew to 2 minutes by default: a node restarted meanwhile stayed "refused"
#: that long to a caller keeping its channel. Capped at 2 s (nodes also redial at once: ``PeerChannels.failed``).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    *_COMMON_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
#: Options for the node's server (``grpc.aio.server(options=...)``).
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = _COMMON_OPTIONS


# ------------------------------------------------------------------ malloc

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 16 << 20, trim_threshold: int = 128 << 20) -> bool:
    """Keep MiB-sized message buffers on the heap instead of fresh mmap pages (glibc only).

    Every chunk makes several short-lived buffers of about FETCH_CHUNK_SIZE
    (gRPC slices, the Python bytes of each message). By default glibc serves
    them with mmap or trims the heap after each free, so every message pays
    page faults: measured, a Fetch stream without it was 30-45 % slower
    (docs/BENCHMARKS.md). Raising both thresholds keeps those pages
    in the process (up to ``trim_threshold`` of free heap is retained).

    Process-wide: call once at start-up of a node or a pulling process, not
    from library code. Returns False (and changes nothing) without glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; glibc rejects an mmap threshold above 32 MiB.
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


# ------------------------------------------------------------------ codec


def _varint(value: int) -> bytes:
    """Protobuf base-128 varint of a u64 (caller checks the range)."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_header(offset: int, length: int) -> bytes:
    """The bytes that precede ``length`` bytes of data in an encoded Chunk.

    ``chunk_header(o, len(d)) + d == encode_chunk(o, d)``; useful to a caller
    that reads file data straight into a buffer after the header.
    """
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= _U64_MAX:
        raise InvalidArgument(f"chunk offset must be an integer in [0, 2**64), got {offset!r}")
    if not isinstance(length, int) or length < 0 or length > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"chunk length must be in [0, {MAX_MESSAGE_BYTES}] bytes, got {length!r}")
    head = b"" if offset == 0 else bytes((_TAG_OFFSET,)) + _varint(offset)
    if length:
        head += bytes((_TAG_DATA,)) + _varint(length)
    return head


def encode_chunk(offset: int, data: bytes | bytearray | memoryview) -> bytes:
    """Serialize ``Chunk(offset=offset, data=data)`` exactly as the generated class does.

    One copy of ``data`` (into the returned message); ``data`` may be any
    C-contiguous bytes-like object (a memoryview into a mmap or a read buffer).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"chunk data must be bytes-like, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidArgument("chunk data must be a contiguous buffer")
    if view.itemsize != 1 or view.ndim != 1:
        view = view.cast("B")
    # join copies data once; bytes(header) + data would also, but join
    # accepts a memoryview without an intermediate bytes(view).
    return b"".join((chunk_header(offset, view.nbytes), view))


def _read_varint(buf: bytes | memoryview, pos: int, end: int, what: str) -> tuple[int, int]:
    """Decode a varint at ``pos``; return (value, next pos). At most 10 bytes, value < 2**64."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise IntegrityError(f"malformed Chunk: truncated varint in {what} at byte {pos}")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift >= 70:
            raise IntegrityError(f"malformed Chunk: varint in {what} longer than 10 bytes at byte {pos - 10}")
    if result > _U64_MAX:
        raise IntegrityError(f"malformed Chunk: varint in {what} does not fit in 64 bits")
    return result, pos


def _skip_field(buf: bytes | memoryview, pos: int, end: int, field: int, wire_type: int, depth: int = 0) -> int:
    """Skip one unknown field's value starting at ``pos``; return the next pos."""
    if wire_type == 0:
        return _read_varint(buf, pos, end, f"unknown field {field}")[1]
    if wire_type == 1 or wire_type == 5:
        size = 8 if wire_type == 1 else 4
        if pos + size > end:
            raise IntegrityError(f"malformed Chunk: unknown field {field} needs {size} bytes, {end - pos} left")
        return pos + size
    if wire_type == 2:
        size, pos = _read_varint(buf, pos, end, f"length of unknown field {field}")
        if size > end - pos:
            raise IntegrityError(
                f"malformed Chunk: unknown field {field} claims {size} bytes, {end - pos} left in the message"
            )
        return pos + size
    if wire_type == 3:
        # A group (deprecated, never sent by proto3 peers): skip to its end tag.
        if depth >= _MAX_GROUP_DEPTH:
            raise IntegrityError(f"malformed Chunk: groups nested more than {_MAX_GROUP_DEPTH} deep at byte {pos}")
        while True:
            key, pos = _read_varint(buf, pos, end, f"group field {field}")
            inner_field, inner_type = key >> 3, key & 7
            if inner_type == 4:
                if inner_field != field:
                    raise IntegrityError(f"malformed Chunk: group {field} closed by end tag of field {inner_field}")
                return pos
            if inner_field == 0 or inner_field > _MAX_FIELD:
                raise IntegrityError(f"malformed Chunk: field number {inner_field} inside group {field}")
            pos = _skip_field(buf, pos, end, inner_field, inner_type, depth + 1)
    raise IntegrityError(f"malformed Chunk: field {field} has invalid wire type {wire_type}")


def decode_chunk(buf: bytes | bytearray | memoryview) -> tuple[int, memoryview]:
    """Parse a serialized Chunk into ``(offset, data)`` without copying ``data``.

    ``data`` is a memoryview into ``buf`` (it keeps ``buf`` alive). Unknown
    fields are skipped; a repeated field keeps its last value, as protobuf
    does. Stricter than the generated parser in one way: ``offset`` or ``data``
    sent with the wrong wire type is an error, not an unknown field, since no
    correct peer sends that. Raises ``IntegrityError`` on malformed bytes.
    """
    view = memoryview(buf)
    if view.itemsize != 1 or view.ndim != 1:
        view = view.cast("B")
    end = view.nbytes
    offset = 0
    data_start = data_end = 0
    pos = 0
    # The common case costs a handful of index operations: tag, varint, tag,
    # varint; the general loop below handles any order and unknown fields.
    while pos < end:
        key, pos = _read_varint(view, pos, end, "a field tag")
        field, wire_type = key >> 3, key & 7
        if field == 0 or field > _MAX_FIELD:
            raise IntegrityError(f"malformed Chunk: field number {field} outside [1, {_MAX_FIELD}]")
        if field == 1:
            if wire_type != 0:
                raise IntegrityError(f"malformed Chunk: offset (field 1) has wire type {wire_type}, expected 0 (varint)")
            offset, pos = _read_varint(view, pos, end, "offset")
        elif field == 2:
            if wire_type != 2:
                raise IntegrityError(f"malformed Chunk: data (field 2) has wire type {wire_type}, expected 2 (bytes)")
            size, pos = _read_varint(view, pos, end, "data length")
            if size > end - pos:
                raise IntegrityError(f"malformed Chunk: data claims {size} bytes, {end - pos} left in the message")
            data_start, data_end = pos, pos + size
            pos += size
        else:
            if wire_type == 4:
                raise IntegrityError(f"malformed Chunk: unexpected group end tag for field {field}")
            pos = _skip_field(view, pos, end, field, wire_type)
    return offset, view[data_start:data_end]


# ------------------------------------------------------------ gRPC plumbing

#: What a raw-bytes Fetch behavior looks like: (FetchRequest, context) -> encoded chunks.
FetchBehavior = Callable[[fabric_pb2.FetchRequest, Any], AsyncIterator[bytes] | Iterator[bytes]]


def fetch_method_handler(behavior: FetchBehavior) -> grpc.RpcMethodHandler:
    """A unary-stream handler for Fetch whose behavior yields ``encode_chunk`` bytes.

    The response serializer is the identity (gRPC sends the yielded bytes
    as-is); the request is parsed with the generated class. ``behavior`` may
    be an async generator (grpc.aio server) or a plain generator (sync server).
    """
    return grpc.unary_stream_rpc_method_handler(
        behavior,
        request_deserializer=fabric_pb2.FetchRequest.FromString,
        response_serializer=None,
    )


def _decode_or_error(buf: bytes) -> tuple[int, memoryview] | IntegrityError:
    """The stub's deserializer: returns the error instead of raising it.

    gRPC swallows a deserializer's exception: grpc.aio then hands the caller
    ``None`` as if it were a message (a malformed chunk would look like a
    short stream). Returning the error lets the stub raise it in the caller.
    """
    try:
        return decode_chunk(buf)
    except IntegrityError as exc:
        return exc


def fetch_stub(channel: grpc.aio.Channel | grpc.Channel) -> Callable[..., Any]:
    """A Fetch function on ``channel`` that yields ``(offset, data: memoryview)`` tuples.

    On a grpc.aio channel: ``fetch(request, timeout=..., metadata=...)`` is an
    async generator (``async for offset, data in fetch(req)``); on a sync
    channel, a plain generator. Keyword arguments go to the gRPC call.
    A malformed chunk raises ``IntegrityError`` and cancels the call; gRPC
    failures raise ``grpc.RpcError`` / ``grpc.aio.AioRpcError`` as usual;
    closing the generator early (``break``, ``aclose()``) cancels the call.
    Interoperates with any server that speaks fabric.v1 (generated or this module).
    """
    multicallable = channel.unary_stream(
        FETCH_METHOD,
        request_serializer=fabric_pb2.FetchRequest.SerializeToString,
        response_deserializer=_decode_or_error,
        _registered_method=True,
    )
    if isinstance(channel, grpc.aio.Channel):

        async def fetch_aio(request: fabric_pb2.FetchRequest, **call_kwargs: Any) -> AsyncIterator[tuple[int, memoryview]]:
            call = multicallable(request, **call_kwargs)
            try:
                async for item in call:
                    if not isinstance(item, tuple):
                        raise item if isinstance(item, IntegrityError) else IntegrityError(f"Fetch stream yielded {item!r}")
                    yield item
            finally:
                call.cancel()  # a no-op once the call has finished

        return fetch_aio

    def fetch_sync(request: fabric_pb2.FetchRequest, **call_kwargs: Any) -> FetchCall:
        return FetchCall(multicallable(request, **call_kwargs))

    return fetch_sync


class FetchCall:
    """A sync Fetch call: iterates ``(offset, data)``; ``cancel()`` works from any thread (a stall watchdog)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> FetchCall:
        return self

    def __next__(self) -> tuple[int, memoryview]:
        item = next(self._call)
        if not isinstance(item, tuple):
            self._call.cancel()
            raise item if isinstance(item, IntegrityError) else IntegrityError(f"Fetch stream yielded {item!r}")
        return item

    def cancel(self) -> None:
        self._call.cancel()  # a no-op once the call has finished

    def initial_metadata(self) -> Any:
        """The server's initial metadata (blocks until it arrives, or the call ends)."""
        return self._call.initial_metadata()

    def trailing_metadata(self) -> Any:
        """The server's trailing metadata (once the stream ended)."""
        return self._call.trailing_metadata()


class _Capture:
    """Stands in for a server to record the handlers the generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] | None = None

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = dict(handlers)


def fabric_method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The generated ``fabric.v1.Fabric`` handlers for ``servicer``, with Fetch on the raw-bytes path.

    Taken from ``add_FabricServicer_to_server`` itself, so methods added to the
    .proto later are picked up without editing this module.
    """
    capture = _Capture()
    fabric_pb2_grpc.add_FabricServicer_to_server(servicer, capture)
    if capture.handlers is None or "Fetch" not in capture.handlers:
        raise InvalidArgument("generated add_FabricServicer_to_server registered no Fetch handler; regenerate fabric/v1")
    capture.handlers["Fetch"] = fetch_method_handler(servicer.Fetch)
    return capture.handlers


def add_fabric_servicer_to_server(servicer: Any, server: grpc.aio.Server | grpc.Server) -> None:
    """Drop-in for ``add_FabricServicer_to_server``: same service, Fetch yields pre-encoded bytes."""
    handlers = fabric_method_handlers(servicer)
    service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
