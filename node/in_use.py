"""Adapters being served, pulled or loaded right now: an eviction never drops one of them (``adapter_fabric.node.eviction``)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class InUse:
    """Adapter ids and digests being served, pulled or loaded right now (counted: several may use one at once)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # taken on the event loop and on I/O threads

    @contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        """Count ``keys`` (ids or digests) in use until the block ends."""
        with self._lock:
            self._counts.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._counts.subtract(keys)
                for key in keys:
                    if self._counts[key] <= 0:
                        del self._counts[key]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return self._counts[key] > 0

    def keys(self) -> frozenset[str]:
        """Every id and digest in use now, read at once (an eviction's list asks of 100,000: one lock, not two per digest)."""
        with self._lock:
            return frozenset(self._counts)  # a key leaves when its count reaches 0
