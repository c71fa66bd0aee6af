"""The data channel's framing: a hello from the puller, then typed frames from the node. Pure: no I/O.

The data channel is a plain TCP connection (TLS exactly when the node's gRPC
is) that carries one Fetch's chunk bytes, so they cross user space once: the
node writes them from its committed blob with ``sendfile`` and the puller
reads them with ``recv_into`` into the buffer that feeds the BLAKE3 check,
the store write and the slot row. Control calls stay on gRPC. Framing, as
the systems this follows do (Dragonfly's piece transfer over TCP, Kraken's
length-prefixed pieces), is a fixed header and then raw bytes:

- puller -> node, once: ``MAGIC`` (4 bytes), a big-endian u32 length, then a
  serialized ``fabric.v1.DataHello`` (the token, and the ``FetchRequest``).
- node -> puller, any number of frames: a 16-byte header (kind u8, 3 zero
  bytes, offset u64, length u32) and ``length`` bytes of payload:

  ``CHUNK``  offset = the chunk's offset in the file, payload = its bytes
  ``PICKED`` payload = the chunk indexes a super-seeding node will send (as Fetch's initial metadata); offset = 1 + the
           other pullers it served lately (``fabric-other-pullers``), 0 when it does not say (older nodes)
  ``END``    the stream ended well; payload = what the node holds (``b"C"`` all, ``b"V"`` + bitmap, or empty)
  ``ERROR``  the stream ended with an error; payload = a serialized ``ErrorDetail`` (as Fetch's trailer)

A connection carries requests one after another: after ``END``, a puller that set ``DataHello.keep_open`` may send its
next hello on it (a node that does not keep connections closes it, and the puller connects again). The node closes it
after ``ERROR``, and after ``node.data_server.KEEP_OPEN_S`` without a hello.
"""

from __future__ import annotations

import struct

from adapter_fabric.errors import IntegrityError, InvalidArgument
from adapter_fabric.v1 import fabric_pb2

__all__ = [
    "CHUNK", "END", "ERROR", "FRAME", "HELLO_PREFIX", "KINDS", "MAGIC", "MAX_HELLO_BYTES", "MAX_META_BYTES", "PICKED",
    "decode_end", "decode_hello", "decode_picked", "encode_end", "encode_hello", "encode_picked", "frame_header",
    "hello_length", "parse_frame_header",
]

MAGIC = b"FDC1"
HELLO_PREFIX = struct.Struct("!4sI")
#: a hello carries a token, a FetchRequest and a verified bitmap (1 bit per chunk): 1 MiB is 8M chunks
MAX_HELLO_BYTES = 1 << 20
#: PICKED, END and ERROR payloads: chunk lists, bitmaps and bounded messages
MAX_META_BYTES = 4 << 20

FRAME = struct.Struct("!B3xQI")
CHUNK, PICKED, END, ERROR = 1, 2, 3, 4
KINDS = {CHUNK: "CHUNK", PICKED: "PICKED", END: "END", ERROR: "ERROR"}


def encode_hello(hello: fabric_pb2.DataHello) -> bytes:
    """The bytes a puller sends first."""
    body = hello.SerializeToString()
    if len(body) > MAX_HELLO_BYTES:
        raise InvalidArgument(f"a data channel hello of {len(body)} bytes is over the {MAX_HELLO_BYTES}-byte limit")
    return HELLO_PREFIX.pack(MAGIC, len(body)) + body


def hello_length(prefix: bytes) -> int:
    """The length announced by a hello's first 8 bytes; InvalidArgument for anything but this protocol."""
    magic, length = HELLO_PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise InvalidArgument(f"not a fabric data channel request (it starts with {magic!r}, not {MAGIC!r})")
    if length > MAX_HELLO_BYTES:
        raise InvalidArgument(f"a data channel hello of {length} bytes is over the {MAX_HELLO_BYTES}-byte limit")
    return length


def decode_hello(body: bytes) -> fabric_pb2.DataHello:
    """The hello a puller sent; InvalidArgument when it does not parse."""
    hello = fabric_pb2.DataHello()
    try:
        hello.ParseFromString(body)
    except Exception:  # noqa: BLE001 (protobuf raises DecodeError, and others on some malformed input)
        raise InvalidArgument("the data channel hello is not a DataHello message") from None
    return hello


def frame_header(kind: int, offset: int, length: int) -> bytes:
    """The 16 bytes before a frame's payload."""
    return FRAME.pack(kind, offset, length)


def parse_frame_header(header: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(kind, offset, length)``; IntegrityError for an unknown kind or a metadata frame over its bound."""
    kind, offset, length = FRAME.unpack(header)
    if kind not in KINDS:
        raise IntegrityError(f"the data channel sent a frame of unknown kind {kind}")
    if kind != CHUNK and length > MAX_META_BYTES:
        raise IntegrityError(f"the data channel sent a {KINDS[kind]} frame of {length} bytes (at most {MAX_META_BYTES})")
    return kind, offset, length


def encode_picked(chunks: list[int], others: int | None = None) -> tuple[int, bytes]:
    """A PICKED frame's offset and payload: the other pullers (1 + the count; 0: not said), and the chunk indexes,
    comma-separated ASCII (as Fetch's ``fabric-picked-chunks``). An older puller reads the payload and ignores the offset."""
    return (0 if others is None else 1 + others), ",".join(map(str, chunks)).encode("ascii")


def decode_picked(payload: bytes, offset: int = 0) -> tuple[list[int], int | None]:
    """The chunk indexes of a PICKED frame, and the other pullers it says (None: not said); IntegrityError when malformed."""
    try:
        return [int(c) for c in payload.decode("ascii").split(",") if c], (offset - 1 if offset else None)
    except (UnicodeDecodeError, ValueError):
        raise IntegrityError(f"malformed PICKED frame {payload[:100]!r}") from None


def encode_end(complete: bool, bitmap: bytes | None) -> bytes:
    """An END payload: ``b"C"`` when the node holds every chunk, ``b"V"`` + its verified bitmap, or empty."""
    if complete:
        return b"C"
    return b"V" + bitmap if bitmap is not None else b""


def decode_end(payload: bytes) -> tuple[bytes | None, bool]:
    """``(bitmap or None, complete)`` from an END payload, as ``fetch_metadata.holding`` reads a trailer."""
    if payload == b"C":
        return None, True
    if payload[:1] == b"V":
        return bytes(payload[1:]), False
    if not payload:
        return None, False
    raise IntegrityError(f"malformed END frame {payload[:100]!r}")
