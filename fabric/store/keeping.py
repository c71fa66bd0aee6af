"""What the cache keeps about adapters beside the refs: when each was last used, and which an operator kept.

Recency is the mtime of the adapter's ref file (stamped at commit, promote, pull
and serve; never back in time, whatever the clock does): it survives a restart
and costs no scan until an eviction reads it.
Kept ids are empty marker files under ``kept/`` (named as refs are).
"""

from __future__ import annotations

import os
import threading
import time

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.store.files import decode_id, encode_id
from adapter_fabric.store.layout import StoreLayout

#: the least a stamp moves past the highest: a microsecond (seconds as a float keep it; a nanosecond is lost)
STEP_NS = 1000


class Recency:
    """When each adapter id was last used: its ref file's mtime, a stamp that never goes back.

    A stamp is the wall clock, or a microsecond past the highest stamp seen when the clock is behind it
    (stepped back by NTP, a VM restored from a snapshot): an id used after a step still counts as newer than
    every id used before it, so one stamped ahead of the clock does not stay out of eviction's reach until the
    clock catches up. The highest stamp is what this object stamped or read (``saw``): the store's collection reads
    every ref's stamp once (``Catalog.stamps``; a node runs it on an I/O thread after start-up).
    """

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self._high = 0  # ns: the highest stamp seen
        self._lock = threading.Lock()

    def touch(self, adapter_id: str) -> None:
        """Mark ``adapter_id`` used now (nothing when it is not staged)."""
        stamp = self._next()
        try:
            os.utime(self.layout.ref(adapter_id), ns=(stamp, stamp))
        except FileNotFoundError:
            pass

    def last_used(self, adapter_id: str) -> float:
        """Seconds since the epoch of its last use (its stamp); 0.0 when it is not staged."""
        try:
            stamp = os.stat(self.layout.ref(adapter_id)).st_mtime_ns
        except FileNotFoundError:
            return 0.0
        self.saw(stamp)
        return stamp / 1e9

    def _next(self) -> int:
        with self._lock:
            self._high = max(time.time_ns(), self._high + STEP_NS)
            return self._high

    def saw(self, stamp: int) -> None:
        """A stamp read elsewhere (a ref's mtime): the next stamp goes past it."""
        with self._lock:
            self._high = max(self._high, stamp)


class KeptIds:
    """Adapter ids an operator kept: an evicting store never drops them (they survive restarts)."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self.root = layout.root / "kept"
        self.root.mkdir(exist_ok=True)

    def set(self, adapter_id: str, kept: bool) -> None:
        """Keep (or stop keeping) a staged id; ``AdapterNotFound`` when keeping one that is not staged."""
        marker = self.root / encode_id(adapter_id)
        if not kept:
            marker.unlink(missing_ok=True)
            return
        if not self.layout.ref(adapter_id).exists():
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store: only a staged adapter can be kept")
        marker.touch()

    def __contains__(self, adapter_id: str) -> bool:
        return (self.root / encode_id(adapter_id)).exists()

    def ids(self) -> frozenset[str]:
        """Every kept id, from one listing (a marker per id: ``in`` costs a stat each)."""
        try:
            return frozenset(decode_id(entry.name) for entry in os.scandir(self.root))
        except FileNotFoundError:  # kept/ removed by hand: nothing is kept (as ``in`` answers)
            return frozenset()

    def count(self) -> int:
        """How many ids are kept."""
        return len(self.ids())
