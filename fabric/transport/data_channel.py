"""The puller's side of the data channel: Fetch's chunk bytes over a raw TCP (or TLS) connection.

A node announces its channel's port beside its gRPC replies
(``fetch_metadata.DATA_PORT_KEY``); ``DataChannels`` remembers it per peer and
sends each Fetch as a hello, then reads frames (``adapter_fabric.transport.data_frames``),
on a connection kept from an earlier request to the same peer when there is
one (``idle_connections``), else on a new one. Each chunk is read with ``recv_into`` into one buffer per call,
which the caller verifies and writes from before asking for the next
(``swarm_fetch``): the bytes are not copied in user space on the way.

The channel is an optimisation, never a requirement: a peer that announces
none, or whose port cannot be reached (a firewall, an older node), is fetched
from over gRPC, and a failed connect keeps that peer on gRPC for
``RETRY_AFTER_S``. A stream refused by the channel's own bound (``DATA_CONNECTIONS_BOUND``; from an older node, which names
no bound: unless it is one of several of ours, ``grpc_when_busy``), or that breaks before its first frame, goes over gRPC
at once (nothing of it was received), and keeps that peer on gRPC for ``BUSY_RETRY_AFTER_S`` (counted by reason).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from adapter_fabric.errors import DATA_CONNECTIONS_BOUND, FabricError, IntegrityError, PeerUnavailable, QuotaExceeded
from adapter_fabric.observability.metrics import DATA_CONNECTIONS, DATA_FALLBACKS
from adapter_fabric.rpc.status import error_from_detail
from adapter_fabric.store.lock_watch import check_no_store_lock
from adapter_fabric.transport import data_frames, fetch_metadata
from adapter_fabric.transport.chunk_buffers import RECEIVE_BUFFERS
from adapter_fabric.transport.discovery import split_host_port
from adapter_fabric.transport.idle_connections import IdleConnections
from adapter_fabric.transport.membership import Membership
from adapter_fabric.v1 import fabric_pb2

__all__ = ["BUSY_RETRY_AFTER_S", "CONNECT_TIMEOUT_S", "DataCall", "DataChannelFailed", "DataChannels", "RETRY_AFTER_S"]

#: a gRPC Fetch of the same request: what a stream the channel refuses or drops before its first frame becomes
Fallback = Callable[[], Any]

log = logging.getLogger(__name__)

#: seconds to connect (and finish TLS); a port that does not answer by then is taken as blocked
CONNECT_TIMEOUT_S = 3.0
#: seconds a peer whose channel could not be reached is fetched from over gRPC before the channel is tried again
RETRY_AFTER_S = 60.0
#: the same, for a channel that refused a stream as busy, or broke before its first frame
BUSY_RETRY_AFTER_S = 10.0
#: a socket-level bound on one read: the swarm's stall watchdog cuts a silent stream long before this
READ_TIMEOUT_S = 300.0
#: a chunk's bytes are read with SO_RCVLOWAT up to this: the reader wakes once per this much, not per few segments
#: (before: ~34 recv calls, each a GIL hand-off, per 1 MiB chunk at 200 Mbit/s; strace of a swarm node, issue 34)
WAKE_BYTES = 512 << 10
#: Linux's TCP_QUICKACK (None elsewhere): set once a chunk is read and nothing more is queued (the reader will wait), it sends the ACK
#: the kernel would hold back to ride on our next request. A node sending with Nagle on (all before issue 34's ninth step) held its END
#: behind it for the 40 ms delayed-ACK timer (80 one-chunk requests: 1.18 s, 0.29 s with it). Set after every chunk: ~8 ms more CPU a pull.
QUICKACK = getattr(socket, "TCP_QUICKACK", None)


def _queued(sock: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])  # bytes not yet read


class DataChannelFailed(Exception):
    """A data channel stream ended without END: ``error`` is the peer's refusal, or PeerUnavailable when the connection broke."""

    def __init__(self, error: FabricError) -> None:
        super().__init__(str(error))
        self.error = error


class DataChannels:
    """The data channels of a node's peers: the ports they announced, and how to reach them (TLS, token).

    ``members``: who gets the token and ``tls``'s client certificate; others get no token and ``anonymous_tls``
    (``adapter_fabric.transport.membership``; None: every peer gets them).
    """

    def __init__(
        self, tls: ssl.SSLContext | None = None, token: str | None = None, tls_name: str = "", *,
        members: Membership | None = None, anonymous_tls: ssl.SSLContext | None = None,
    ) -> None:
        self._tls = tls
        self._anonymous_tls = anonymous_tls if anonymous_tls is not None else tls
        self._token = token or ""
        self._tls_name = tls_name
        self._members = members
        self._idle = IdleConnections()
        self._ports: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def learn(self, peer: str, metadata: Any) -> None:
        """Remember the data port ``peer`` announced in a reply's metadata (no announcement: it offers none)."""
        port = fetch_metadata.data_port(metadata)
        with self._lock:
            if port is None:
                self._ports.pop(peer, None)
            else:
                self._ports[peer] = port

    def port(self, peer: str) -> int | None:
        """The data port to use for ``peer`` now: None when it announced none, or its channel failed lately."""
        with self._lock:
            port = self._ports.get(peer)
            if port is not None and self._down_until.get(peer, 0.0) > time.monotonic():
                return None
            return port

    def fall_back(self, peer: str, reason: str, exc: BaseException, for_s: float = RETRY_AFTER_S) -> None:
        """Fetch from ``peer`` over gRPC for ``for_s`` seconds (its channel failed for ``reason``)."""
        with self._lock:
            self._down_until[peer] = time.monotonic() + for_s
        DATA_FALLBACKS.labels(reason).inc()
        log.warning("data channel of %s unreachable (%s: %s): fetching from it over gRPC for %.0fs", peer, type(exc).__name__, exc, for_s)

    def open(
        self, peer: str, request: fabric_pb2.FetchRequest, holder: tuple[int, bytes] | None, chunk_size: int,
        fallback: Fallback | None = None, behalf: str = "",
    ) -> DataCall | None:
        """A stream of ``request`` from ``peer`` over its channel; None when there is none to use (the caller uses gRPC).

        ``fallback``: the same request over gRPC, which the call becomes when the channel refuses it as busy or breaks
        before its first frame. ``behalf``: the caller this pull runs for (``DataHello.on_behalf_of``), sent to members
        only, as the token is.
        """
        port = self.port(peer)
        if port is None:
            return None
        member = self._members is None or self._members.admits(peer)
        hello = fabric_pb2.DataHello(token=self._token, fetch=request, on_behalf_of=behalf) if member else fabric_pb2.DataHello(fetch=request)
        hello.keep_open = True
        if holder is not None:
            hello.holder_port, hello.holder_bitmap = holder
        check_no_store_lock(f"a data channel stream from {peer}")
        sent = data_frames.encode_hello(hello)
        key = (peer, port, member)  # a kept connection carries the credentials it was opened with
        kept = self._idle.take(key)
        if kept is not None:
            try:
                kept.sendall(sent)
            except OSError:
                kept.close()
                kept = None

        def connect() -> socket.socket | None:
            return self._connect(peer, port, self._tls if member else self._anonymous_tls, sent)

        sock = kept if kept is not None else connect()
        if sock is None:
            return None
        DATA_CONNECTIONS.labels("new" if kept is None else "kept").inc()
        on_refusal = (lambda reason, exc: self.fall_back(peer, reason, exc, BUSY_RETRY_AFTER_S)) if fallback is not None else None
        return DataCall(
            sock, peer, port, chunk_size, fallback, on_refusal,
            keep=lambda done: self._idle.put(key, done), reconnect=connect if kept is not None else None,
        )

    def _connect(self, peer: str, port: int, tls: ssl.SSLContext | None, hello: bytes) -> socket.socket | None:
        """A new connection to ``peer``'s channel with ``hello`` sent; None when it cannot be reached (the peer is then fetched from over gRPC)."""
        host = split_host_port(peer)[0]
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self.fall_back(peer, "connect", exc)
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=self._tls_name or host)
            sock.settimeout(READ_TIMEOUT_S)
            sock.sendall(hello)
        except ssl.SSLError as exc:  # the same certificates as gRPC: a mismatch is a configuration error, named
            sock.close()
            self.fall_back(peer, "tls", exc)
            return None
        except OSError as exc:
            sock.close()
            self.fall_back(peer, "connect", exc)
            return None
        return sock

    def close(self) -> None:
        """Close the connections kept between requests."""
        self._idle.close()


class DataCall:
    """One Fetch over the data channel, with gRPC ``FetchCall``'s interface: iterate ``(offset, data)``, cancel from any thread.

    ``data`` is a view of the call's one buffer: valid until the next item is asked for. With a ``fallback``, a stream refused
    by the channel's own bound or broken before its first frame becomes that gRPC call (``on_refusal`` is told why, first).
    ``keep`` takes the connection once its stream ended well (END), for the next request; ``reconnect`` (given when the connection
    was kept from an earlier request) opens a new one, the same hello sent, when the kept one is closed before the first frame (the node let it go meanwhile).
    """

    def __init__(
        self, sock: socket.socket, peer: str, port: int, chunk_size: int,
        fallback: Fallback | None = None, on_refusal: Callable[[str, BaseException], None] | None = None,
        *, keep: Callable[[socket.socket], None] | None = None, reconnect: Callable[[], socket.socket | None] | None = None,
    ) -> None:
        self._sock = sock
        self._keep = keep
        self._reconnect = reconnect
        self._end_lock = threading.Lock()  # a cancel from another thread never cuts a connection already kept
        self._peer = peer
        self._port = port
        self._chunk_size = chunk_size
        self._fallback = fallback
        self._on_refusal = on_refusal
        self._grpc: Any = None  # the gRPC call this one became, if it did
        self._began = False
        self._failure: BaseException | None = None  # how the stream failed before its first frame, raised by the first next()
        self._buffer: bytearray | None = None  # from RECEIVE_BUFFERS at the first chunk, given back at END
        self._header = bytearray(data_frames.FRAME.size)
        self._pending: tuple[int, int, int] | None = None  # a frame header read ahead by initial_metadata
        self._picked: tuple[list[int], int | None] | None = None  # the PICKED frame's chunks and other pullers
        self.grpc_when_busy = True  # an older node's busy refusal: False for one of several streams (its limit refuses gRPC too)
        self._trailer: tuple[bytes | None, bool] | None = None
        self._cancelled = False
        self._closed = False

    # ------------------------------------------------------------ reading

    def _read_exact(self, view: memoryview, wake: bool = False) -> None:
        """Fill ``view``; ``wake``: a chunk's bytes, read with SO_RCVLOWAT (plain TCP only: under TLS the bytes in the
        socket are not those read), never above what is still to come, and back to 1 before the next frame header."""
        got, lowat = 0, 1
        wake = wake and not isinstance(self._sock, ssl.SSLSocket)
        try:
            while got < len(view):
                if wake and min(len(view) - got, WAKE_BYTES) != lowat:
                    lowat = min(len(view) - got, WAKE_BYTES)
                    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)  # an EOF, error or shutdown (cancel) still wakes it
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    what = "was cancelled" if self._cancelled else "closed the data channel mid-stream"
                    raise DataChannelFailed(PeerUnavailable(f"{self._peer} {what}"))
                got += n
            if lowat != 1:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            if wake and QUICKACK is not None and _queued(self._sock) < data_frames.FRAME.size:
                self._sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
        except (OSError, ValueError) as exc:  # ValueError: the socket was closed under us (cancel)
            raise DataChannelFailed(PeerUnavailable(f"{self._peer}: the data channel broke: {exc}")) from None

    def _next_header(self) -> tuple[int, int, int]:
        if self._pending is not None:
            header, self._pending = self._pending, None
            return header
        self._read_exact(memoryview(self._header))
        return data_frames.parse_frame_header(self._header)

    def _payload(self, length: int) -> bytes:
        payload = bytearray(length)
        self._read_exact(memoryview(payload))
        return bytes(payload)

    def _begin(self) -> None:
        """Read the first frame's header (once): a refusal as busy, or a break before it, hands the request to gRPC."""
        if self._began:
            return
        self._began = True
        try:
            header = self._first_header()
            if header[0] == data_frames.ERROR:
                error = self._error(header[2])
                # gRPC escapes only the channel's own bound; an older node names none (then guessed: ``grpc_when_busy``)
                busy = isinstance(error, QuotaExceeded) and (error.bound == DATA_CONNECTIONS_BOUND if error.bound else self.grpc_when_busy)
                if busy and self._switch("busy", error):
                    return
                raise DataChannelFailed(error)
            self._pending = header
        except DataChannelFailed as exc:
            if not self._cancelled and isinstance(exc.error, PeerUnavailable) and self._switch("broken", exc.error):
                return
            self._fail(exc)
        except IntegrityError as exc:
            self._fail(exc)

    def _first_header(self) -> tuple[int, int, int]:
        """The first frame's header; a kept connection found closed is replaced by a new one, once, the same hello sent."""
        try:
            return self._next_header()
        except DataChannelFailed:
            reconnect, self._reconnect = self._reconnect, None
            if reconnect is None or self._cancelled:
                raise
        self._sock.close()
        sock = reconnect()
        if sock is None:  # unreachable now: the caller's fallback (gRPC) takes the request
            raise DataChannelFailed(PeerUnavailable(f"{self._peer}: the data channel could not be reached again"))
        DATA_CONNECTIONS.labels("new").inc()
        with self._end_lock:
            self._sock = sock
        if self._cancelled:
            self.cancel()
        return self._next_header()

    def _switch(self, reason: str, error: FabricError) -> bool:
        """Become the gRPC call of the same request (nothing of it was received here); False when there is none to become."""
        if self._fallback is None:
            return False
        self.close()
        if self._on_refusal is not None:
            self._on_refusal(reason, error)
        self._grpc = self._fallback()
        if self._cancelled:
            self._grpc.cancel()
        return True

    def _fail(self, exc: BaseException) -> None:
        """The stream failed before its first frame: the first next() raises ``exc``."""
        self.close()
        self._failure = exc

    def _error(self, length: int) -> FabricError:
        return error_from_detail(self._payload(length)) or PeerUnavailable(f"{self._peer} ended the data channel stream with an error")

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        self._begin()
        if self._grpc is not None:
            return next(self._grpc)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._trailer is not None or self._closed:
            raise StopIteration
        try:
            kind, offset, length = self._next_header()
            if kind == data_frames.CHUNK:
                if length > self._chunk_size:
                    raise IntegrityError(f"{self._peer} sent a chunk of {length} bytes on the data channel; chunks are {self._chunk_size}")
                if self._buffer is None:
                    self._buffer = RECEIVE_BUFFERS.take(self._chunk_size)
                view = memoryview(self._buffer)[:length]
                self._read_exact(view, wake=True)
                return offset, view
            if kind == data_frames.END:
                self._trailer = data_frames.decode_end(self._payload(length))
                self._release()
                if self._buffer is not None:  # the reader asked past its last chunk: done with it (this thread)
                    buffer, self._buffer = self._buffer, None
                    RECEIVE_BUFFERS.give(buffer)
                raise StopIteration
            if kind == data_frames.ERROR:
                raise DataChannelFailed(self._error(length))
            raise IntegrityError(f"{self._peer} sent a {data_frames.KINDS[kind]} frame in the middle of a data channel stream")
        except (DataChannelFailed, IntegrityError):
            self.close()
            raise

    # ------------------------------------------------------------ FetchCall's interface

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a super-seeding node picked (``fetch_metadata.picked``), read from the first frame; empty when it did not say."""
        self._begin()
        if self._grpc is not None:
            return self._grpc.initial_metadata()
        if self._picked is None and self._pending is not None and self._pending[0] == data_frames.PICKED:
            header, self._pending = self._pending, None
            try:
                self._picked = data_frames.decode_picked(self._payload(header[2]), header[1])
            except (DataChannelFailed, IntegrityError) as exc:
                self._fail(exc)  # raised by the first next()
        return fetch_metadata.picked(*self._picked) if self._picked is not None else ()

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        """What the node holds, as Fetch's trailer says it (``fetch_metadata.holding`` reads it), and this channel's port."""
        if self._grpc is not None:
            return self._grpc.trailing_metadata()
        announced = fetch_metadata.announce_data_port(self._port)
        if self._trailer is None:
            return announced
        bitmap, complete = self._trailer
        held = fetch_metadata.complete() if complete else fetch_metadata.verified(bitmap) if bitmap is not None else ()
        return (*held, *announced)

    def cancel(self) -> None:
        """Cut the stream (any thread): a read blocked on it returns at once."""
        self._cancelled = True
        if self._grpc is not None:
            self._grpc.cancel()
            return
        with self._end_lock:
            if self._closed:
                return
            try:
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)  # the base method: an SSL socket keeps its state for the reader
            except OSError:
                pass

    def _release(self) -> None:
        """The stream ended well: the connection goes to ``keep`` for the next request (closed when cancelled or not kept)."""
        with self._end_lock:
            if self._closed:
                return
            self._closed = True
            if self._keep is None or self._cancelled:
                self._sock.close()
                return
        self._keep(self._sock)

    def close(self) -> None:
        """Release the connection (the stream ended)."""
        with self._end_lock:
            if self._closed:
                return
            self._closed = True
        self._sock.close()
