"""Jobs in the background on a few threads, each key at most once at a time, a bounded number waiting: a placement's
pushes and announcements (``adapter_fabric.node.homes``). A job past the bound is refused, and its caller counts it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("fabric.node")

#: jobs running at once, and waiting at most, per ``KeyedJobs``
CONCURRENT = 2
MAX_QUEUED = 256


class KeyedJobs:
    """Jobs on ``CONCURRENT`` threads, at most ``MAX_QUEUED`` waiting, each key once at a time; more are refused (False)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENT, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending: set[tuple] = set()

    def submit(self, key: tuple, job: Callable[[], object]) -> bool:
        with self._lock:
            if key in self._pending:
                return True
            if len(self._pending) >= MAX_QUEUED:
                return False
            self._pending.add(key)

        def run() -> None:
            try:
                job()
            except Exception:  # noqa: BLE001 (a background job's failure is logged; the node goes on)
                log.exception("background job %s failed", key[:2])
            finally:
                with self._lock:
                    self._pending.discard(key)

        self._pool.submit(run)
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
