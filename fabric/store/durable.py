"""The store's lock and its durable writes: temp files renamed into place, fsync'ed, their directory too."""

from __future__ import annotations

import fcntl
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from adapter_fabric.store.files import fsync_dir, pwrite_all
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


class TempFiles:
    """Temp files in one directory, each flock'ed by its writer until renamed (recovery removes only unheld ones)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def new(self) -> tuple[int, Path]:
        """A new empty temp file, locked by the returned fd until it is closed."""
        while True:
            path = self.directory / f"{os.getpid()}-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                return fd, path
            os.close(fd)  # a cleaner took it between create and lock

    def write_atomic(self, dest: Path, data: bytes) -> None:
        """``dest`` holds ``data`` whole or not at all, durably, even across a crash."""
        path = self.blob(data)  # unlocked until renamed: recovery spares a live writer's temp files by its pid
        try:
            os.rename(path, dest)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        fsync_dir(dest.parent)

    def replace(self, dest: Path, data: bytes) -> None:
        """``dest`` holds ``data`` whole or not at all, not synced: for what a power cut may lose (an upload's resume notes)."""
        fd, path = self.new()
        try:
            pwrite_all(fd, data, 0)
            os.rename(path, dest)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def blob(self, data: bytes) -> Path:
        """A synced temp file holding ``data``, for the caller to rename into place (or unlink)."""
        fd, path = self.new()
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path
