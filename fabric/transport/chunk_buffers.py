"""Receive buffers of a chunk's size, reused from one data channel stream to the next.

A swarm makes about a thousand one-chunk requests per rollout; a fresh ``bytearray(chunk_size)`` per request
cost each of them a zeroed allocation and a page fault per page on its first receive (about a tenth of a
puller's Python time, measured with ``py-spy --gil``). A stream takes a buffer when its first chunk arrives and
gives it back when it ended well, on the thread that read it, once its last chunk was used (the caller asks for
the next item only when done with the previous one). A stream cut or failed does not give its buffer back: a
cancel comes from another thread, and the reader may still hold a view of it.

Bounded: at most ``max_bytes`` of idle buffers are kept in all (the newest returned go first when over).
"""

from __future__ import annotations

import threading

__all__ = ["BufferPool", "POOL_BYTES", "RECEIVE_BUFFERS"]

#: idle buffers kept in all, in bytes: a pull's streams at 1 MiB chunks, with room for a second pull
POOL_BYTES = 32 << 20


class BufferPool:
    """Idle buffers by size; thread-safe."""

    def __init__(self, max_bytes: int = POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers now."""
        with self._lock:
            return self._bytes

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes: an idle one when there is one (its old bytes are left in it), else a new one."""
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                self._bytes -= size
                return idle.pop()
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        """``buffer`` is no longer used by anyone: keep it for the next ``take`` of its size, within the bound."""
        size = len(buffer)
        with self._lock:
            if self._bytes + size > self.max_bytes:
                return
            self._idle.setdefault(size, []).append(buffer)
            self._bytes += size


#: the data channel's receive buffers (``data_channel.DataCall``)
RECEIVE_BUFFERS = BufferPool()
