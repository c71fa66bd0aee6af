"""The node's data channel: Fetch's chunk bytes on a TCP port of their own (``adapter_fabric.transport.data_frames``).

Each connection carries requests one after another. The node answers each with the same pieces
a gRPC Fetch sends (``PeerReads.pieces``: committed blobs verified at rest,
the verified chunks of a download still arriving, super-seeding picks), and
writes a committed blob's chunks with ``loop.sendfile``: the kernel copies
them from the page cache to the socket (asyncio falls back to reads and
writes under TLS, where the bytes must be encrypted in user space).

The same guards as gRPC Fetch, before any byte is sent: TLS and mTLS with the
node's certificates; the bearer token when the node requires one for Fetch;
the streams-per-peer bound, shared with gRPC Fetch; the upload rate. And its
own (``node.data_accept``): connections counted from their accept, bounded per
source address and in all, idle ones (no hello yet) shed first, a silent one
holding no buffer and no TLS state; a first byte, handshake and hello that
must come within ``HELLO_TIMEOUT_S``; and a reader that stops reading is cut
once a frame has waited ``write_stall`` seconds (the node's --stall-timeout)
plus its length at ``MIN_READ_RATE``. Each of these deadlines is a timer on the connection's own task
(``asyncio.timeout``), not ``asyncio.wait_for``, which made a task per wait: a task per chunk (6% of a swarm
node's Python time, py-spy, issue 34).

A puller that asks for it (``DataHello.keep_open``) sends its next request on the same connection once a stream
ended well (END): a swarm's requests are one or two chunks, and a connection each cost as much CPU as the copies
the channel saves. Between requests the connection is idle again (shed first at a bound, as one that never sent a
hello) and is closed after ``KEEP_OPEN_S`` without a request; every request is admitted on its own hello (token,
policy, streams per peer). A refusal or a broken stream still ends the connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from contextlib import aclosing

from adapter_fabric.errors import FabricError, InvalidArgument, PermissionDenied, Unauthenticated
from adapter_fabric.node.data_accept import HELLO_TIMEOUT_S, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_SOURCE, Connection, Listener
from adapter_fabric.node.gate import AccessGate
from adapter_fabric.node.peer_reads import BytesPiece, FilePiece, PeerReads, Picked, Piece
from adapter_fabric.observability.metrics import DATA_STREAMS_SERVED
from adapter_fabric.rpc import bounds
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.rpc.security import BEHALF_WITHOUT_POLICY, BearerAuth
from adapter_fabric.rpc.status import error_detail, public_message
from adapter_fabric.transport import data_frames
from adapter_fabric.v1 import fabric_pb2

__all__ = ["DataServer", "HELLO_TIMEOUT_S", "KEEP_OPEN_S", "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_SOURCE", "MIN_READ_RATE"]

log = logging.getLogger("fabric.node.data")

#: bytes/s below which a reader counts as stalled
MIN_READ_RATE = 64 << 10
#: seconds a kept connection waits for its next request before the node closes it
KEEP_OPEN_S = 30.0


def _sendfile_now(writer: asyncio.StreamWriter, piece: FilePiece) -> int:
    """Bytes of ``piece`` the socket's buffer takes at once (``os.sendfile`` until it would block), when nothing waits in
    the transport before them and it is plain TCP: ``loop.sendfile`` pauses the transport, waits on futures and adds a
    writer per chunk even when the buffer has room (5% of a swarm node's Python time, py-spy, issue 34)."""
    transport = writer.transport
    if transport.is_closing() or transport.get_write_buffer_size() or transport.get_extra_info("sslcontext") is not None:
        return 0
    sock, sent = transport.get_extra_info("socket"), 0
    try:
        while sent < piece.length:
            n = os.sendfile(sock.fileno(), piece.file.fileno(), piece.offset + sent, piece.length - sent)
            if n == 0:  # the file ended early (cut under us): what is left goes to the loop, as before
                break
            sent += n
    except (BlockingIOError, InterruptedError):
        pass
    return sent


def _sans(writer: asyncio.StreamWriter) -> list[str]:
    """The subject alternative names of the client certificate (mTLS), as gRPC's auth context lists them."""
    cert = writer.get_extra_info("peercert") or {}
    return [str(value) for _, value in cert.get("subjectAltName", ())]


class DataServer:
    """Serves ``PeerReads.pieces`` on a TCP (or TLS) port; requests one after another on a connection kept open."""

    def __init__(
        self, reads: PeerReads, streams: PeerStreamLimit, *, auth: BearerAuth | AccessGate | None = None, tls: ssl.SSLContext | None = None,
        write_stall: float = 10.0, max_connections: int = MAX_CONNECTIONS, max_per_source: int = MAX_CONNECTIONS_PER_SOURCE,
    ) -> None:
        """``write_stall``: seconds a frame may wait for a reader that takes nothing, beyond its length at MIN_READ_RATE."""
        self.reads = reads
        self.streams = streams
        self.auth = auth  # checked when it guards Fetch (--auth-peer-reads), or always (--policy: node.gate)
        self.write_stall = write_stall
        # a peer may hold as many connections as it may hold Fetch streams
        self.listener = Listener(self._serve, tls=tls, max_connections=max_connections, max_per_source=max(max_per_source, streams.limit))
        self._open: set[asyncio.StreamWriter] = set()  # streams past their hello
        self._greeting: set[asyncio.StreamWriter] = set()  # connections whose hello has begun to arrive

    @property
    def connections(self) -> int:
        """Connections counted now (from their accept)."""
        return len(self.listener.admission)

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock``, listening already (``data_accept.listen_socket``: its port was announced before the server existed)."""
        await self.listener.start(sock)

    async def close(self, grace: float) -> None:
        """Stop listening; open streams get ``grace`` seconds to finish (as gRPC's in-flight calls do), then are cut.

        A connection whose hello has begun to arrive is answered within the same grace, so a puller that asked as the
        node began draining hears why (the drain's refusal), not a connection closed without a word."""
        self.listener.stop_accepting()
        deadline = asyncio.get_running_loop().time() + grace
        while (self._open or self._greeting) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.listener.close()  # what is left is cut, and its task ended here (not cancelled at the loop's end)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: Connection, hello_within: float) -> None:
        host = connection.host
        clean = False
        try:
            prefix = None
            while True:
                clean, keep = await self._request(reader, writer, connection, hello_within, prefix)
                if not keep:
                    return
                self.listener.admission.idle(connection)  # between requests: shed first, as a connection without a hello
                prefix = await self._next_request(reader)
                if prefix is None:
                    return  # the puller closed it, or sent nothing for KEEP_OPEN_S
                hello_within = HELLO_TIMEOUT_S
        except TimeoutError:
            log.debug("data channel connection from %s cut: its next hello did not end in %gs", host, HELLO_TIMEOUT_S)
            clean = False
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            log.debug("data channel connection from %s broke between requests: %s", host, exc)
            clean = False
        finally:  # a cancel (shed while idle, or the node stopping) passes through here too, and goes on
            self._open.discard(writer)
            if clean:
                writer.close()  # what is written still goes out
            else:
                writer.transport.abort()  # a reader that stopped: drop what waits for it

    async def _request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: Connection, hello_within: float, prefix: bytes | None,
    ) -> tuple[bool, bool]:
        """Read one hello and answer it: ``(clean, keep)``: the connection may close gracefully; it may carry another request."""
        host = connection.host
        counted = False
        try:
            self._greeting.add(writer)  # its first bytes are here (a fresh connection's, or a kept one's next prefix)
            try:
                async with asyncio.timeout(hello_within):
                    hello = await self._hello(reader, prefix)
            finally:
                self._greeting.discard(writer)
            self.listener.admission.busy(connection)  # no longer idle: never shed
            self._open.add(writer)
            still = None
            if isinstance(self.auth, AccessGate):
                still = await self.auth.admit_data(hello, _sans(writer))
            elif self.auth is not None and self.auth.peer_reads:
                if not self.auth.token_matches(hello.token):
                    raise Unauthenticated(f"the data channel needs this cluster's bearer token; the hello carried {'a wrong' if hello.token else 'no'} token")
                if hello.on_behalf_of:
                    raise PermissionDenied(BEHALF_WITHOUT_POLICY)
            self.streams.enter(host)
            counted = True
            holder = (host.strip("[]"), hello.holder_port, hello.holder_bitmap) if 0 < hello.holder_port < 65536 and hello.holder_bitmap else None
            async with aclosing(self.reads.pieces(hello.fetch, holder)) as pieces:
                async for piece in pieces:
                    if still is not None:
                        await still.check()  # a policy reload since: the next chunk goes only if it still allows the stream
                    await self._send(writer, piece)
            DATA_STREAMS_SERVED.labels("ok").inc()
            return True, hello.keep_open
        except FabricError as exc:
            DATA_STREAMS_SERVED.labels("refused").inc()
            log.info("data channel stream from %s refused: %s: %s", host, type(exc).__name__, exc)
            return await self._refuse(writer, exc), False
        except TimeoutError:
            DATA_STREAMS_SERVED.labels("broken").inc()
            log.info("data channel stream to %s cut: it read nothing for %gs (or sent no hello in %gs)", host, self.write_stall, HELLO_TIMEOUT_S)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as exc:
            DATA_STREAMS_SERVED.labels("broken").inc()
            log.debug("data channel stream to %s broke: %s", host, exc)
        finally:
            self._open.discard(writer)
            if counted:
                self.streams.leave(host)
        return False, False

    async def _next_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """The first bytes of a kept connection's next hello; None when the puller closed it or sent none for KEEP_OPEN_S."""
        try:
            async with asyncio.timeout(KEEP_OPEN_S):
                return await reader.readexactly(data_frames.HELLO_PREFIX.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ConnectionResetError("the connection closed inside a hello") from None
            return None
        except TimeoutError:
            return None

    async def _hello(self, reader: asyncio.StreamReader, prefix: bytes | None = None) -> fabric_pb2.DataHello:
        try:
            if prefix is None:
                prefix = await reader.readexactly(data_frames.HELLO_PREFIX.size)
            length = data_frames.hello_length(prefix)
            hello = data_frames.decode_hello(await reader.readexactly(length))
        except asyncio.IncompleteReadError:
            raise InvalidArgument("the data channel connection closed before its hello ended") from None
        bounds.check(hello)  # the same bounds as every RPC's fields, before the hello is used or logged
        return hello

    async def _send(self, writer: asyncio.StreamWriter, piece: Piece) -> None:
        if isinstance(piece, FilePiece):
            writer.write(data_frames.frame_header(data_frames.CHUNK, piece.offset, piece.length))
            sent = _sendfile_now(writer, piece)
            if sent < piece.length:  # the socket's buffer is full: the loop sends the rest as the reader takes it
                # sendfile: page cache to socket in the kernel (plain TCP); under TLS asyncio reads and encrypts instead
                async with asyncio.timeout(self._stall_bound(piece.length - sent)):
                    await asyncio.get_running_loop().sendfile(writer.transport, piece.file, piece.offset + sent, piece.length - sent)
            return
        if isinstance(piece, BytesPiece):
            kind, offset, payload = data_frames.CHUNK, piece.offset, piece.data
        elif isinstance(piece, Picked):
            kind, (offset, payload) = data_frames.PICKED, data_frames.encode_picked(piece.chunks, piece.others)
        else:
            kind, offset, payload = data_frames.END, 0, data_frames.encode_end(piece.complete, piece.bitmap)
        writer.write(data_frames.frame_header(kind, offset, len(payload)))
        writer.write(payload)
        await self._drain(writer, len(payload))

    async def _drain(self, writer: asyncio.StreamWriter, length: int) -> None:
        """Wait until the reader takes what is buffered, within the stall bound. With nothing buffered (the socket took
        the frame at once) the transport is not paused and ``drain`` returns at once (or raises for a lost connection):
        no timer for it (two a request: PICKED and END)."""
        if writer.transport.get_write_buffer_size() == 0:
            await writer.drain()
            return
        async with asyncio.timeout(self._stall_bound(length)):
            await writer.drain()

    def _stall_bound(self, length: int) -> float:
        return self.write_stall + length / MIN_READ_RATE

    async def _refuse(self, writer: asyncio.StreamWriter, exc: FabricError) -> bool:
        """Send the error as an ERROR frame (the caller rebuilds the same type); False when the connection no longer takes it."""
        payload = error_detail(exc, public_message(exc))
        try:
            writer.write(data_frames.frame_header(data_frames.ERROR, 0, len(payload)) + payload)
            async with asyncio.timeout(self.write_stall):
                await writer.drain()
        except (TimeoutError, ConnectionError, OSError):
            return False
        return True
