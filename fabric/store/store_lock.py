"""The store's lock: one ``flock`` around every metadata change, between threads and processes alike."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from adapter_fabric.store.lock_watch import noted


class StoreLock:
    """``flock`` on the store's lock file, held around every metadata change.

    Each acquisition opens the file afresh, so threads of one process exclude
    each other as processes do (an flock belongs to the open file, not the process).
    Not re-entrant: code that runs under it says so and never takes it again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def held(self) -> Iterator[None]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with noted("store"):
                yield
        finally:
            os.close(fd)  # closing drops the flock
