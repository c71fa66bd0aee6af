"""One HTTP exchange with an inference engine, bounded as a whole: one deadline for the whole reply, and a size.

urllib's timeout bounds each socket operation, not the reply: an engine that sends one byte every 2 s holds a
read for as long as it likes (an eviction waiting on it held its locks for minutes). Here a timer cuts the
connection once the deadline passes, whatever the exchange is doing (connecting, TLS, the headers, the body),
and the body is read up to ``max_bytes + 1`` bytes at most. No redirect is followed: what an engine lists is
read only from the engine named (a 302 to another port is a refusal naming where it pointed, never that
server's list). Every failure is ``PeerUnavailable`` naming the engine and the call, never a traceback.
"""

from __future__ import annotations

import http.client
import socket
import threading
from urllib.parse import urlsplit

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.store.lock_watch import check_no_store_lock

__all__ = ["exchange"]

#: bytes asked of the socket at a time while reading a body
READ_PIECE = 64 << 10


class _Deadline:
    """Cuts ``connection``'s socket when ``seconds`` pass (a blocked read or write then returns at once)."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self.connection = connection
        self.passed = threading.Event()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        self.passed.set()
        sock = self.connection.sock  # None while connecting: connect() is bounded by the same seconds, and checked after
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the base method: a TLS socket mid-handshake too
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


def exchange(
    url: str, what: str, label: str, deadline: float, max_bytes: int,
    body: bytes | None = None, headers: dict[str, str] | None = None, accept: tuple[int, ...] = (),
) -> bytes:
    """The body (at most ``max_bytes + 1`` bytes: more means the reply is larger) of the engine's answer to ``what``
    ("GET /v1/models", "POST /load_lora_adapter") at ``url``, all of it within ``deadline`` seconds.

    A 2xx reply, or one whose status is in ``accept`` (an engine that answers a refusal with a JSON body), returns
    its body; anything else is ``PeerUnavailable`` naming the engine ``label`` and the call.
    """
    check_no_store_lock(f"engine {label}: {what}")
    method = what.split(" ", 1)[0]
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        connection = kind(parts.hostname or "", parts.port, timeout=deadline)
    except ValueError as exc:  # a port out of range: the URL was checked at start, but say so rather than raise
        raise PeerUnavailable(f"engine {label} cannot be reached for {what}: {str(exc)[:200]}") from None
    timer = _Deadline(connection, deadline)
    try:
        connection.connect()
        if timer.passed.is_set():
            raise TimeoutError
        target = parts.path or "/"
        connection.request(method, target + ("?" + parts.query if parts.query else ""), body=body, headers=headers or {})
        reply = connection.getresponse()
        if 300 <= reply.status < 400:
            where = str(reply.getheader("Location", ""))[:200]
            raise PeerUnavailable(
                f"engine {label} answered {what} with HTTP {reply.status}, a redirect to {where!r}: an engine is read only at the URL "
                f"given (no redirect is followed); give the engine's own address"
            )
        if not 200 <= reply.status < 300 and reply.status not in accept:
            raise PeerUnavailable(f"engine {label} answered {what} with HTTP {reply.status}")
        data = _read_body(reply, max_bytes)
        if timer.passed.is_set():
            raise TimeoutError  # cut mid-body: what was read is not the whole reply
        return data
    except (OSError, http.client.HTTPException, ValueError) as exc:  # HTTPException: a reply cut short or malformed
        if timer.passed.is_set() or isinstance(exc, TimeoutError):
            raise PeerUnavailable(f"engine {label} did not answer {what} within {deadline:g}s (a bound on the whole reply)") from None
        reason = getattr(exc, "reason", None) or exc
        raise PeerUnavailable(f"engine {label} did not answer {what}: {type(exc).__name__}: {str(reason)[:200]}") from None
    finally:
        timer.cancel()
        connection.close()


def _read_body(reply: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of the body (one more than allowed says it is too large)."""
    pieces: list[bytes] = []
    total = 0
    while total <= max_bytes:
        piece = reply.read1(min(READ_PIECE, max_bytes + 1 - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)
