"""Stamps: what one ``stat`` says about whether a file or directory changed since it was last read.

``FileStamp`` (inode, size, mtime, ctime) of a path or an open descriptor: taken
after our own write or read, a different one later means someone else wrote.
ctime cannot be set back from user space; a change in the same timestamp tick
as the stamp is the one case it misses (kernels since 6.13 use fine-grained
ctimes once observed, which taking a stamp does).

``DirStamp`` (a directory's mtime, and when it was read): file timestamps are
coarse, so a change in the same tick as a read can leave the time unmoved.
As git does with its "racily clean" index entries, a reading taken within
``RACY_NS`` of the mtime it saw is not settled: it is trusted only as long as
the caller's rule allows (``DirSizes`` rescans it, ``RefIndex`` trusts its own
change provisionally and rebuilds once the tick is past).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

#: a directory read this long after its mtime saw every change made in that mtime's tick (timestamps are a few ms coarse)
RACY_NS = 1_000_000_000


class FileStamp(NamedTuple):
    """A file's identity and the times a write moves."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def file_stamp(file: Path | str | int) -> FileStamp:
    """The stamp of a path or an open descriptor (``FileNotFoundError`` for a path that does not exist)."""
    st = os.fstat(file) if isinstance(file, int) else os.stat(file)
    return FileStamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DirStamp(NamedTuple):
    """A directory's mtime and the time it was read at (both ns)."""

    mtime_ns: int
    read_ns: int

    @property
    def settled(self) -> bool:
        """The read came long enough after the mtime that no change of that tick can hide behind it."""
        return self.read_ns - self.mtime_ns >= RACY_NS

    def unchanged(self, mtime_ns: int) -> bool:
        """The directory's mtime is still the one read, and that read is settled: what was read still holds."""
        return mtime_ns == self.mtime_ns and self.settled


def dir_stamp(mtime_ns: int, read_ns: int | None = None) -> DirStamp:
    """A stamp of a directory whose mtime was ``mtime_ns`` when it was read (now, or at ``read_ns`` when the read began)."""
    return DirStamp(mtime_ns, time.time_ns() if read_ns is None else read_ns)
