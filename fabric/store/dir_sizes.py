"""The bytes held under a fanned-out directory of immutable files, without re-reading it whole on each call.

Committed blobs live as ``blobs/blake3/<2 hex>/<root>``: files are only ever
added or removed by rename or unlink, never rewritten, so a fan-out
directory whose modification time has not moved still holds what it held.
A call stats the fan-out directories (at most 256) and rescans only those
that moved: the store's usage costs a few hundred stats at 100,000 adapters
instead of a ``stat`` per file (~29 s per call before).

File timestamps are coarse (a kernel tick), so a change in the same tick as
a scan could leave the time unmoved: a scan whose stamp is not settled
(``adapter_fabric.store.stamps.DirStamp``) is done again on the next call
rather than trusted.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

from adapter_fabric.store.stamps import DirStamp, dir_stamp


class _Scan(NamedTuple):
    stamp: DirStamp
    total: int


class DirSizes:
    """Sum of file sizes under ``top`` (any depth), rescanning only the top's subdirectories that changed."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self._scans: dict[str, _Scan] = {}
        self._lock = threading.Lock()

    def total(self) -> int:
        """Bytes of every file under the top directory; 0 when it does not exist."""
        total = 0
        seen: set[str] = set()
        try:
            entries = list(os.scandir(self.top))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
                    continue
                mtime_ns = entry.stat(follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                continue
            seen.add(entry.name)
            total += self._subdir_total(entry.name, mtime_ns)
        with self._lock:
            for gone in set(self._scans) - seen:
                del self._scans[gone]
        return total

    def _subdir_total(self, name: str, mtime_ns: int) -> int:
        with self._lock:
            scan = self._scans.get(name)
        if scan is not None and scan.stamp.unchanged(mtime_ns):
            return scan.total
        started_ns = time.time_ns()  # before reading: a change during the scan moves the time past it
        total = tree_bytes(self.top / name)
        with self._lock:
            self._scans[name] = _Scan(dir_stamp(mtime_ns, started_ns), total)
        return total


def tree_bytes(top: Path) -> int:
    """Bytes of every file under ``top``, each ``stat`` once; files that vanish meanwhile count nothing."""
    total = 0
    for dirpath, _, names in os.walk(top):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total
