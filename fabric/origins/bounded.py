"""Copying an origin's bytes into a file under the fetch's bounds: a size cap per file and one deadline.

A read timeout alone does not stop a slow drip (a byte every few seconds
resets it each time), so a watchdog closes the source when the fetch's
deadline passes; the read then fails and the copy is refused as
``OriginTooSlow``. Bytes past the file's cap are never written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from adapter_fabric.errors import LimitExceeded, OriginTooSlow
from adapter_fabric.origins.base import FetchLimits

#: bytes asked of the source per read
READ_BLOCK = 256 << 10


@contextmanager
def watchdog(limits: FetchLimits, close: Callable[[], None]) -> Iterator[threading.Event]:
    """Call ``close`` (from a timer thread) if the block still runs at the fetch's deadline; the event says it fired."""
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        try:
            close()
        except Exception:  # noqa: BLE001 (closing a half-read stream may raise anything; the reader learns of it by its failed read)
            pass

    timer = threading.Timer(max(0.0, limits.deadline - time.monotonic()), expire)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def copy_to_file(read: Callable[[int], bytes], close: Callable[[], None], dest: Path, name: str, limits: FetchLimits, what: str) -> int:
    """Write what ``read(n)`` returns (b"" at the end) into ``dest`` until the end; the bytes written.

    ``LimitExceeded`` once the file passes its cap (the bytes past it are not written), ``OriginTooSlow`` when the
    fetch's deadline passes first. ``read`` may raise anything once ``close`` ran: that is a deadline, by name.
    """
    cap = limits.cap(name)
    written = 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with watchdog(limits, close) as fired:
            while True:
                try:
                    block = read(READ_BLOCK)
                except Exception:
                    if fired.is_set() or limits.expired():  # the client's own read timeout may fire before the watchdog
                        raise _too_slow(limits, what, name, written) from None
                    raise
                if fired.is_set():
                    raise _too_slow(limits, what, name, written)
                if not block:
                    break
                if written + len(block) > cap:
                    raise LimitExceeded(f"{what}: {name} is more than {cap} bytes, the most this node accepts; nothing was staged")
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
                written += len(block)
    finally:
        os.close(fd)
    return written


def _too_slow(limits: FetchLimits, what: str, name: str, written: int) -> OriginTooSlow:
    return OriginTooSlow(
        f"{what}: {name} not received within the origin's timeout of {limits.timeout:g}s ({written} bytes came: a slow or stalled origin); "
        f"nothing was staged"
    )
