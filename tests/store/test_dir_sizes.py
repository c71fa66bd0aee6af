"""The store's usage from cached fan-out directory sizes: always what is on disk, rescanning only what moved."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from adapter_fabric.store import dir_sizes
from adapter_fabric.store.dir_sizes import DirSizes


def write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def age(directory: Path, seconds: float = 60.0) -> None:
    """Set a directory's time into the past, as if it had not changed for a while (a scan may trust it)."""
    then = time.time() - seconds
    os.utime(directory, (then, then))


def test_the_total_follows_every_add_and_remove_at_once(tmp_path: Path) -> None:
    sizes = DirSizes(tmp_path / "blobs")
    assert sizes.total() == 0  # not created yet
    write(tmp_path / "blobs" / "ab" / "ab01", 100)
    assert sizes.total() == 100
    write(tmp_path / "blobs" / "ab" / "ab02", 50)  # same directory, same tick: rescanned (racy), not trusted
    write(tmp_path / "blobs" / "cd" / "cd01", 7)
    assert sizes.total() == 157
    (tmp_path / "blobs" / "ab" / "ab01").unlink()
    assert sizes.total() == 57
    (tmp_path / "blobs" / "cd" / "cd01").unlink()
    (tmp_path / "blobs" / "cd").rmdir()
    assert sizes.total() == 50


def test_an_unchanged_directory_is_not_read_again_and_a_change_after_trust_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "blobs"
    for fan in ("00", "01", "02"):
        write(top / fan / f"{fan}aa", 10)
        age(top / fan)
    sizes = DirSizes(top)
    assert sizes.total() == 30
    scanned: list[str] = []
    real = dir_sizes.tree_bytes
    monkeypatch.setattr(dir_sizes, "tree_bytes", lambda path: scanned.append(path.name) or real(path))
    assert sizes.total() == 30
    assert scanned == []  # every fan-out directory trusted: a few stats, no file read
    write(top / "01" / "01bb", 5)  # moves 01's time past its trusted scan
    assert sizes.total() == 35
    assert scanned == ["01"]
