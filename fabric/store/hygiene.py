"""Store hygiene: uploads and partial downloads nobody resumes expire, so their bytes leave the quota.

An interrupted upload or pull keeps its verified prefix to resume (that is the
point), but one never resumed would hold disk and quota forever, invisible to
``fabric ls``. ``leftovers`` lists them with their age (time since the last
write) and size; ``expire_abandoned`` removes those older than a bound, under
the store's lock and only when no writer holds them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

from adapter_fabric.store.files import remove_if_unheld, try_lock
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.store_lock import StoreLock

UPLOAD = "upload"
PARTIAL = "partial"


@dataclass(frozen=True)
class Leftover:
    """An upload or partial download in the store: what it is, its bytes, and how long it has been untouched."""

    kind: str  # UPLOAD or PARTIAL
    path: Path
    adapter_id: str
    digest: str  # partial: the adapter digest; upload: the weights file's whole-file BLAKE3
    bytes: int
    age_seconds: float
    in_use: bool


def _describe(directory: Path, kind: str) -> tuple[str, str]:
    name = "meta.json" if kind == UPLOAD else "manifest.json"
    try:
        raw = json.loads((directory / name).read_bytes())
        return str(raw.get("adapter_id", "")), str(raw.get("blake3" if kind == UPLOAD else "digest", directory.name))
    except (OSError, ValueError, AttributeError):
        return "", directory.name if kind == PARTIAL else ""


def _held(directory: Path) -> bool:
    try:
        fd = os.open(directory / "lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        return not try_lock(fd)  # a flock on a fresh descriptor conflicts with the writer's, in this process too
    finally:
        os.close(fd)


def _size_and_mtime(directory: Path) -> tuple[int, float]:
    size, newest = 0, 0.0
    try:
        newest = directory.stat().st_mtime
        for entry in os.scandir(directory):
            info = entry.stat(follow_symlinks=False)
            newest = max(newest, info.st_mtime)
            size += info.st_size if entry.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:
        pass
    return size, newest


@dataclass(frozen=True)
class LeftBytes:
    """What one upload or partial download directory holds, and for which id (a tenant's quota counts it: ``store.tenants``)."""

    key: str  # the directory's name: an upload's key, a partial's digest
    adapter_id: str
    bytes: int


def _entries(layout: StoreLayout, skip: Container[str] = ()) -> list[tuple[str, Path, int, float, str, str]]:
    """``(kind, directory, bytes, newest mtime, adapter id, digest)`` of every upload and partial in ``layout``'s store, but
    those named in ``skip`` (not read)."""
    found = []
    for kind, top in ((UPLOAD, layout.uploads), (PARTIAL, layout.partials)):
        try:
            entries = list(os.scandir(top))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.name in skip or not entry.is_dir(follow_symlinks=False):
                continue
            directory = Path(entry.path)
            size, mtime = _size_and_mtime(directory)
            found.append((kind, directory, size, mtime, *_describe(directory, kind)))
    return found


def left_bytes(layout: StoreLayout, skip: Container[str] = ()) -> list[LeftBytes]:
    """The bytes every upload and partial download in ``layout``'s store (a ``StoreLayout``) holds, by the id it is for;
    unordered. ``skip``: directory names left unread (the ones writers hold: a tenant counts those through their
    reservations, and a StageMany holds dozens open while each of its writers asks)."""
    return [LeftBytes(directory.name, adapter_id, size) for _, directory, size, _, adapter_id, _ in _entries(layout, skip)]


def leftovers(layout: StoreLayout, now: float | None = None) -> list[Leftover]:
    """Every upload and partial download in ``layout``'s store, oldest first."""
    now = time.time() if now is None else now
    found = [
        Leftover(kind, directory, adapter_id, digest, size, max(0.0, now - mtime), _held(directory))
        for kind, directory, size, mtime, adapter_id, digest in _entries(layout)
    ]
    return sorted(found, key=lambda item: -item.age_seconds)


def expire_abandoned(layout: StoreLayout, lock: StoreLock, max_age_seconds: float, now: float | None = None) -> list[Leftover]:
    """Remove the uploads and partials untouched for over ``max_age_seconds`` that no writer holds; what was removed."""
    if max_age_seconds <= 0:
        return []
    removed = []
    for item in leftovers(layout, now):
        if item.age_seconds <= max_age_seconds or item.in_use:
            continue
        with lock.held():  # no commit or recovery runs while it goes
            if remove_if_unheld(item.path):
                removed.append(item)
    return removed
