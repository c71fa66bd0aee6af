"""The data channel's listener: which connections it takes, from their accept to a stream ready for its hello.

Every connection is counted from its accept (``node.data_admission``: bounded per source address and in all,
idle ones shed first), and until the peer sends a byte it costs nothing but its descriptor: only then is it
handed to asyncio as a stream and, under TLS, only then does its handshake start, a few at a time
(``MAX_HANDSHAKES``: each holds asyncio's 256 KiB TLS read buffer). Silent connections, TLS or not, hold no
buffers (1,100 silent TLS connections once took a node from 53 to 462 MB, uncounted until their handshake
ended). The handshake and the hello share one deadline, ``HELLO_TIMEOUT_S``. The accept loop is this module's:
an accept that fails for want of descriptors is one WARNING per state and a short pause (asyncio's own server
logged a traceback for each retry, 751 of them at a 1,024 open-files limit).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

from adapter_fabric.errors import DATA_CONNECTIONS_BOUND, QuotaExceeded
from adapter_fabric.node.data_admission import Admission
from adapter_fabric.observability.logs import StateLog
from adapter_fabric.observability.metrics import DATA_STREAMS_SERVED
from adapter_fabric.rpc.status import error_detail, public_message
from adapter_fabric.transport import data_frames

log = logging.getLogger("fabric.node.data")

#: seconds a connection gets for its first byte, its TLS handshake and its hello together
HELLO_TIMEOUT_S = 10.0
#: connections open at once (at most a quarter of the open-files limit); past it the oldest idle one is shed, else the new one refused
MAX_CONNECTIONS = 256
#: connections one source address holds at once (at least --max-streams-per-peer)
MAX_CONNECTIONS_PER_SOURCE = 64
#: connections the kernel queues before accept (a burst of honest peers is not dropped to SYN retries)
ACCEPT_BACKLOG = 512
#: TLS handshakes under way at once, in all and per source address
MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE = 32, 4
#: seconds the accept loop pauses when the process has no descriptor left
ACCEPT_RETRY_S = 0.2
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def peer_host(peername: object) -> str:
    """The peer's host as gRPC Fetch's stream count names it (``adapter_fabric.rpc.limits.peer_host``): IPv6 in brackets."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    return f"[{host}]" if ":" in host else host


def connection_bound(wanted: int = MAX_CONNECTIONS) -> int:
    """``wanted``, or a quarter of the open-files limit when that is less (the rest is the store's, gRPC's, the probes')."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(8, min(wanted, soft // 4))


@dataclass(eq=False)
class Connection:
    """One accepted connection: its socket and source, and the task that serves it (cancelled to shed it)."""

    sock: socket.socket
    host: str
    task: asyncio.Task | None = field(default=None, repr=False)
    started: bool = False  # its task ran (a task cancelled before its first step runs no cleanup of its own)


#: serves one connection's stream, from its hello on; told the seconds left of the hello deadline
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Connection, float], Awaitable[None]]


class _HandshakeSlots:
    """At most ``total`` TLS handshakes at once, ``per_source`` of them from one address (a connection waits without a buffer)."""

    def __init__(self, total: int = MAX_HANDSHAKES, per_source: int = MAX_HANDSHAKES_PER_SOURCE) -> None:
        self.per_source = per_source
        self._all = asyncio.Semaphore(total)
        self._sources: dict[str, tuple[asyncio.Semaphore, int]] = {}  # source -> (its slots, connections waiting or holding one)

    @asynccontextmanager
    async def slot(self, source: str) -> AsyncIterator[None]:
        slots, users = self._sources.get(source) or (asyncio.Semaphore(self.per_source), 0)
        self._sources[source] = (slots, users + 1)
        try:
            async with slots, self._all:
                yield
        finally:
            slots, users = self._sources[source]
            if users > 1:
                self._sources[source] = (slots, users - 1)
            else:
                del self._sources[source]


def listen_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (0: a free port; no port reuse); OSError when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=ACCEPT_BACKLOG, reuse_port=False)
    sock.setblocking(False)
    return sock


class Listener:
    """Accepts on one port, counts and sheds, and hands each connection that speaks to ``serve`` as a stream."""

    def __init__(self, serve: Serve, *, tls: ssl.SSLContext | None, max_connections: int, max_per_source: int) -> None:
        self.serve = serve
        self.tls = tls
        self.admission = Admission(connection_bound(max_connections), max_per_source)
        self._handshakes = _HandshakeSlots()
        self._connections: set[Connection] = set()
        self._states = StateLog(log)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def start(self, sock: socket.socket) -> None:
        """Accept on ``sock`` (``listen_socket``'s), until ``close``."""
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept_loop(self._sock))

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._sock is not None:
            self._sock.close()

    async def close(self) -> None:
        """Stop accepting, and end every connection still served (their tasks cancelled and awaited: nothing is left to the loop's end)."""
        self.stop_accepting()
        tasks = [c.task for c in self._connections if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*([self._accepting] if self._accepting else []), *tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() < 0:
                    return  # closed: the node stops
                if exc.errno not in _OUT_OF_DESCRIPTORS:  # a peer that reset before its accept (ECONNABORTED), and the like
                    log.debug("data channel: an accept failed: %s", exc)
                    continue
                self._states.note("accept", "short", "data channel: accept() failed for want of descriptors: pausing accepts briefly",
                                  logging.WARNING, error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if self._states.state("accept"):
                self._states.note("accept", "", "data channel: accepting again")
            try:
                # Nagle off, as asyncio sets it only on sockets made with proto IPPROTO_TCP (accept()'s have 0): with it on,
                # a chunk's last (or only) segment waited for the ACK of the frame header before it, which the reader's kernel
                # held for its 40 ms delayed-ACK timer (a 15 KB adapter's request: 44 ms, 0.55 ms without; issue 34)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # reset before we got to it
                sock.close()
                continue
            self._take(Connection(sock, peer_host(peer)))

    def _take(self, connection: Connection) -> None:
        admitted = self.admission.admit(connection, connection.host)
        for idle in admitted.shed:
            self._shed(cast(Connection, idle))  # the admission's keys are the connections this listener counted
        if not admitted.ok:
            self._refuse(connection)
            return
        self._connections.add(connection)
        connection.task = asyncio.create_task(self._serve(connection))

    def _shed(self, idle: Connection) -> None:
        """Close an idle connection to make room (the admission counts it out already)."""
        DATA_STREAMS_SERVED.labels("shed").inc()
        self._connections.discard(idle)
        if idle.task is not None:
            idle.task.cancel()  # its _serve closes the connection
        if not idle.started:
            idle.sock.close()  # accepted in the same burst, its task not run yet: nothing else will

    def _refuse(self, connection: Connection) -> None:
        """No room, and none idle to shed: a plain connection hears why (the peer fetches over gRPC); a TLS one is closed unspoken."""
        DATA_STREAMS_SERVED.labels("refused").inc()
        log.debug("data channel connection from %s refused: %d connections open (%d from one address at most)",
                  connection.host, self.admission.max_connections, self.admission.max_per_source)
        if self.tls is None:
            busy = QuotaExceeded(f"this node's data channel holds {self.admission.max_connections} connections already; fetch over gRPC or retry", DATA_CONNECTIONS_BOUND)
            payload = error_detail(busy, public_message(busy))
            try:
                connection.sock.send(data_frames.frame_header(data_frames.ERROR, 0, len(payload)) + payload)  # a fresh socket's buffer takes it
            except OSError:
                pass
        connection.sock.close()

    async def _serve(self, connection: Connection) -> None:
        connection.started = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HELLO_TIMEOUT_S
        try:
            reader, writer = await asyncio.wait_for(self._open_stream(connection), HELLO_TIMEOUT_S)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            DATA_STREAMS_SERVED.labels("broken").inc()
            log.debug("data channel connection from %s ended before its hello: %s", connection.host, exc or type(exc).__name__)
            self._forget(connection)
            connection.sock.close()
            return
        except asyncio.CancelledError:
            self._forget(connection)
            connection.sock.close()
            raise
        try:
            await self.serve(reader, writer, connection, max(0.0, deadline - loop.time()))
        finally:
            self._forget(connection)

    async def _open_stream(self, connection: Connection) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection as a stream once its peer sent something (its TLS handshake done, a few at a time)."""
        await _readable(connection.sock)
        if self.tls is None:
            return await _stream(connection.sock, None)
        async with self._handshakes.slot(connection.host):
            return await _stream(connection.sock, self.tls)

    def _forget(self, connection: Connection) -> None:
        self.admission.leave(connection)
        self._connections.discard(connection)


async def _readable(sock: socket.socket) -> None:
    """Until ``sock`` has something to read (or its peer closed it)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _stream(sock: socket.socket, tls: ssl.SSLContext | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An accepted socket as asyncio streams (``asyncio.open_connection``'s parts, server side), its TLS handshake done."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock, ssl=tls, ssl_handshake_timeout=HELLO_TIMEOUT_S if tls else None)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
