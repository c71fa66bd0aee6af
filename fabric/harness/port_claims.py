"""Ports drawn by one test process, claimed against every other process on the machine (``free_port``'s second check).

``free_port`` hands out a port that nothing listens on right now; the caller binds it later (a node process
started seconds after, an S3 stand-in, nginx). Two processes drawing at once (pytest-xdist workers) could be
handed the same port between one's draw and its bind: then one bind fails, or one side's client talks to the
other side's server (seen once: an S3 client reading a gRPC node's HTTP/2 frames). So a drawn port is also
claimed here, in a file per port holding the claimer's pid, for the claimer's lifetime: a port claimed by a
live process is never drawn by another; a dead claimer's ports are free again. Claims are made under one flock,
so two processes never take over the same stale claim. Where the directory cannot be written, no claims are
made (the draw's own check remains).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

__all__ = ["PortClaims"]


class PortClaims:
    """Claims of this process on ports, in ``directory`` (shared by every process that draws ports on this machine)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or Path(tempfile.gettempdir()) / "adapter-fabric-ports"
        self._usable: bool | None = None

    def claim(self, port: int) -> bool:
        """Claim ``port`` for this process: False when a live process other than this one holds it."""
        if not self._ready():
            return True
        try:
            lock = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return True
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.directory / str(port)
            holder = _holder(path)
            if holder is not None and holder != os.getpid() and _alive(holder):
                return False
            path.write_text(str(os.getpid()))
            return True
        except OSError:
            return True  # the claim could not be written: the draw's own check remains
        finally:
            os.close(lock)  # releases the flock

    def _ready(self) -> bool:
        if self._usable is None:
            try:
                self.directory.mkdir(mode=0o777, exist_ok=True)
                self._usable = os.access(self.directory, os.W_OK)
            except OSError:
                self._usable = False
        return self._usable


def _holder(path: Path) -> int | None:
    try:
        return int(path.read_text() or "0") or None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
