"""Which of the store's locks the current thread holds, so the layers that wait on the network can check none is held.

Invariant 17 (docs/ARCHITECTURE.md): no lock of the store is held across a
network call, an HTTP read or an engine call. The store's locks note
themselves here while held (a thread-local list, a few nanoseconds); the
peer-call, data-channel and HTTP layers call ``check_no_store_lock`` before
they wait. With ``FABRIC_CHECK_STORE_LOCKS=1`` (the test suite sets it, and
its node processes inherit it) a call made under a store lock raises
``StoreLockHeld`` naming the lock and the call; otherwise the check costs one
attribute read and nothing is raised in production.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: set to 1 to make a network wait under a store lock raise (tests, debugging)
CHECK_VARIABLE = "FABRIC_CHECK_STORE_LOCKS"

_held = threading.local()


class StoreLockHeld(RuntimeError):
    """A network call, HTTP read or engine call was about to wait while this thread held a lock of the store (a bug)."""


def checking() -> bool:
    """Whether ``check_no_store_lock`` raises (read each time: a test may set the variable after import)."""
    return os.environ.get(CHECK_VARIABLE) == "1"


@contextmanager
def noted(name: str) -> Iterator[None]:
    """Note that this thread holds the store's lock ``name`` until the block ends (wrap the lock's acquisition with it)."""
    held: list[str] = _held.__dict__.setdefault("names", [])
    held.append(name)
    try:
        yield
    finally:
        held.remove(name)


def held_now() -> tuple[str, ...]:
    """The store's locks this thread holds, in the order they were taken."""
    return tuple(_held.__dict__.get("names", ()))


def check_no_store_lock(call: str) -> None:
    """Raise ``StoreLockHeld`` (when checking) if this thread holds a lock of the store while it is about to ``call``."""
    names = _held.__dict__.get("names")
    if names and checking():
        raise StoreLockHeld(f"{call} while holding the store's {', '.join(names)} lock (invariant 17: no store lock across a network call)")


class WatchedLock:
    """A ``threading.Lock`` of the store that notes itself while held (``with`` only: the store never acquires by hand)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()
        _held.__dict__.setdefault("names", []).append(self.name)

    def __exit__(self, *exc: object) -> None:
        _held.__dict__["names"].remove(self.name)
        self._lock.release()

    @contextmanager
    def if_free(self) -> Iterator[None]:
        """``with`` the lock only if no thread holds it now; ``BlockingIOError`` otherwise (for the event loop, which must not wait on it)."""
        if not self._lock.acquire(blocking=False):
            raise BlockingIOError(f"the store's {self.name} lock is held")
        try:
            with noted(self.name):
                yield
        finally:
            self._lock.release()
