"""Data channel connections between two requests: kept per peer, bounded, and let go before the node closes them.

A swarm asks a peer for one or two chunks at a time, many times a second; a TCP connect (and a TLS handshake)
per request cost both nodes as much CPU as the copies the data channel saves. A connection whose stream ended
well goes back here, and the next request to the same peer, with the same credentials, takes it.

Bounded: at most ``per_peer`` idle connections per peer and ``total`` in all (the oldest goes first), each kept
``keep_s`` seconds, under the node's own ``KEEP_OPEN_S``, so the puller lets go before the node closes it. A
connection that became readable while idle is stale (the node closed it, or it is not in step): it is closed,
never used. One that the node closes between this check and the hello is caught by the caller, which connects
again (``data_channel.DataCall``).
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["IDLE_KEEP_S", "IDLE_PER_PEER", "IDLE_TOTAL", "IdleConnections"]

#: idle connections kept per peer: a pull keeps one or two requests out per peer, several pulls share them
IDLE_PER_PEER = 4
#: idle connections kept in all: a node of a 1,000-node fleet talks to many peers, and descriptors are the store's too
IDLE_TOTAL = 64
#: seconds an idle connection is kept (the node keeps it 30: node.data_server.KEEP_OPEN_S)
IDLE_KEEP_S = 20.0


def _stale(sock: socket.socket) -> bool:
    """True when an idle connection has something to read (the node closed it: EOF, or a stray byte) or is closed."""
    if sock.fileno() < 0:
        return True
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()  # select() cannot watch descriptors above 1,023
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class IdleConnections:
    """Idle connections by key (peer and credentials), newest last; thread-safe."""

    def __init__(
        self, per_peer: int = IDLE_PER_PEER, total: int = IDLE_TOTAL, keep_s: float = IDLE_KEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_peer = per_peer
        self.total = total
        self.keep_s = keep_s
        self._clock = clock
        self._idle: list[tuple[Hashable, socket.socket, float]] = []  # (key, connection, idle since), oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)

    def take(self, key: Hashable) -> socket.socket | None:
        """The newest idle connection for ``key`` still fit to use; None when there is none (stale ones are closed)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] != key:
                    continue
                _, sock, _ = self._idle.pop(i)
                if not _stale(sock):
                    return sock
                sock.close()
        return None

    def put(self, key: Hashable, sock: socket.socket) -> None:
        """Keep ``sock`` (its stream ended well) for the next request to ``key``; past a bound the oldest is closed."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            mine = [i for i, entry in enumerate(self._idle) if entry[0] == key]
            if len(mine) >= self.per_peer:
                self._idle.pop(mine[0])[1].close()
            if len(self._idle) >= self.total:
                self._idle.pop(0)[1].close()
            self._idle.append((key, sock, now))

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, sock, _ in idle:
            sock.close()

    def _expire(self, now: float) -> None:
        while self._idle and now - self._idle[0][2] >= self.keep_s:
            self._idle.pop(0)[1].close()
