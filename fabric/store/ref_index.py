"""The staged ids, sorted, kept in memory: a page of a listing costs its own entries, not a scan of ``refs/``.

A directory lists in no order, so a page of the ids sorted after a token
would otherwise read every name in ``refs/`` (tens of milliseconds at 20,000
ids, on every page). Here one scan builds a sorted list; this process's
commits and unstages update it (``ref_set``/``ref_removed``, told by the
committer under the store's lock); a page is a binary search and a slice.

Other processes may share the store. Any change to ``refs/`` moves its mtime,
so a page whose ``refs/`` mtime differs from the one the index was built or
last updated at rebuilds it first. One change by another process can hide
behind one of ours in the same timestamp tick; so an index whose stamp is not
settled (``adapter_fabric.store.stamps.DirStamp``) is trusted provisionally,
while that tick is recent, and rebuilt once by the first page after it has
settled.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.store.stamps import RACY_NS, DirStamp, dir_stamp


class RefIndex:
    """Every staged id, sorted; ``names()`` scans ``refs`` for the ids it holds (to build the list)."""

    def __init__(self, refs: Path, names: Callable[[], list[str]]) -> None:
        self.refs = refs
        self._names = names
        self._ids: list[str] = []
        self._stamp: DirStamp | None = None  # refs/ mtime the list matches, and when; None: build on next use
        self._lock = threading.Lock()  # pages on I/O threads, updates under the store's lock

    def page(self, after: str, count: int, keep: Callable[[str], bool] | None = None) -> list[str]:
        """Up to ``count`` ids sorted after ``after`` ("" = from the first); with ``keep``, only ids it answers true for."""
        with self._lock:
            self._refresh()
            start = bisect.bisect_right(self._ids, after)
            if keep is None:
                return self._ids[start : start + count]
            # A scoped caller's page skips the ids it may not read: the walk is as long as the foreign ids in between.
            return list(itertools.islice((i for i in itertools.islice(self._ids, start, None) if keep(i)), count))

    def ref_set(self, adapter_id: str) -> None:
        """This process committed ``adapter_id`` (new, or pointed at another digest)."""
        with self._lock:
            if self._stamp is None:
                return  # not built yet: the first page scans
            at = bisect.bisect_left(self._ids, adapter_id)
            if at == len(self._ids) or self._ids[at] != adapter_id:
                self._ids.insert(at, adapter_id)
            self._restamp()

    def ref_removed(self, adapter_id: str) -> None:
        """This process unstaged ``adapter_id``."""
        with self._lock:
            if self._stamp is None:
                return
            at = bisect.bisect_left(self._ids, adapter_id)
            if at < len(self._ids) and self._ids[at] == adapter_id:
                del self._ids[at]
            self._restamp()

    def _restamp(self) -> None:
        # After our own change: the new mtime is ours, but another process's change in the same tick may hide behind it.
        mtime = os.stat(self.refs).st_mtime_ns
        self._stamp = DirStamp(mtime, mtime)  # not settled, whenever it is read: rebuilt once that tick is past

    def _refresh(self) -> None:
        mtime = os.stat(self.refs).st_mtime_ns  # FileNotFoundError: the store went (the caller names it)
        stamp = self._stamp
        if stamp is not None and stamp.mtime_ns == mtime and (stamp.settled or time.time_ns() - mtime < RACY_NS):
            return  # unchanged; or changed by us so lately that a rebuild now could miss the same tick's change too
        self._ids = sorted(self._names())  # a change during the scan moves the mtime past ``mtime``: rebuilt again next page
        self._stamp = dir_stamp(mtime)
