"""The whole-file sha256 of a file whose chunks are written in any order, folded in file order as they land.

A partial download verifies each chunk against its own digest, and before it
commits it must also check the sha256 of the whole file (invariant 8). Reading
the file back at commit to hash it costs a second pass over the disk cache at
the end of the pull; hashing each chunk as it is written (in order) does the
same CPU work while the rest of the file is still arriving.

Chunks that land beyond the next one expected (several peers send runs of
one file at once) are held in memory up to ``hold_bytes`` when their buffer is
immutable, and are otherwise read back from the file when the gap before them
fills. Not thread-safe on its own: the caller serializes ``add``/``finish``
(the partial does it under its lock, which also keeps its descriptor open).
"""

from __future__ import annotations

import hashlib
from typing import Callable

#: out-of-order chunks kept in memory for the running hash; the rest are read back from disk. Small:
#: a window of concurrent runs skews arrival by a few chunks, and reading a chunk back from the page
#: cache (~0.1 ms per MiB) measured no slower than holding 32 MiB of receive buffers alive
DEFAULT_HOLD_BYTES = 8 << 20


def _immutable(data: bytes | memoryview) -> bool:
    """Whether holding ``data`` keeps exactly these bytes (a memoryview over a reused buffer would not)."""
    if isinstance(data, bytes):
        return True
    return isinstance(data, memoryview) and isinstance(data.obj, bytes)


class InOrderHasher:
    """sha256 over chunks ``0..count-1`` in index order, fed chunk by chunk in whatever order they are written.

    ``read_back(i)`` returns chunk ``i``'s bytes from the file; ``written(i)``
    says whether chunk ``i`` is on disk (verified and written). Every chunk
    is folded in exactly once, in index order, either from the bytes that
    were just written or from the file itself, so the digest covers the
    file's content as written.
    """

    def __init__(
        self,
        count: int,
        written: Callable[[int], bool],
        read_back: Callable[[int], bytes],
        hold_bytes: int = DEFAULT_HOLD_BYTES,
    ) -> None:
        self.count = count
        self._written = written
        self._read_back = read_back
        self._hold_bytes = hold_bytes
        self._sha = hashlib.sha256()
        #: chunks [0, next) are folded into the digest
        self.next = 0
        self._held: dict[int, bytes | memoryview] = {}
        self._held_size = 0
        #: chunks folded in from memory (not read back), for tests and benchmarks
        self.from_memory = 0

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Chunk ``index`` was just written with ``data``: fold in what is now contiguous."""
        if index < self.next or index in self._held:
            return
        if index == self.next:
            self._fold(data, memory=True)
            self._drain()
        elif _immutable(data) and self._held_size + len(data) <= self._hold_bytes:
            self._held[index] = data
            self._held_size += len(data)

    def _fold(self, data: bytes | memoryview, memory: bool) -> None:
        self._sha.update(data)
        self.next += 1
        self.from_memory += memory

    def _drain(self) -> None:
        """Fold in the chunks after ``next`` that are already written (held, or read back)."""
        while self.next < self.count and self._written(self.next):
            held = self._held.pop(self.next, None)
            if held is None:
                self._fold(self._read_back(self.next), memory=False)
            else:
                self._held_size -= len(held)
                self._fold(held, memory=True)

    def finish(self) -> str:
        """The hex digest of all chunks (each must be written by now); reads back whatever was not folded in."""
        self._drain()
        if self.next != self.count:
            raise ValueError(f"chunk {self.next} of {self.count} is not written yet: the whole-file digest is not complete")
        self._held.clear()
        self._held_size = 0
        return self._sha.hexdigest()
