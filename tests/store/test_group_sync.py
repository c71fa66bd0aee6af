"""Issue 34: a commit's blob bytes are synced in its batch's one file round (not one sync each before the commit), and a
batch whose syncs fail leaves no unsynced blob in place for a later commit of the same bytes to take as durable.

Real stores on disk; the sync failure is injected into the store's one path-sync helper (a disk that fails its fsync).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from adapter_fabric.store import AdapterStore, durable
from tests.support.store import SMALL_CHUNK


def _blobs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "blobs" / "blake3").rglob("*") if p.is_file())


def test_a_stage_syncs_its_blobs_in_the_batch_round_before_its_ref(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    synced: list[str] = []
    real = durable._fsync_path

    def sync(path: Path) -> None:
        assert not (tmp_path / "s" / "refs" / "x").exists(), "a ref was placed before its blob's bytes were synced"
        synced.append(path.name)
        real(path)

    monkeypatch.setattr(durable, "_fsync_path", sync)
    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    manifest = store.stage(store_adapters["a"], "x")
    assert sorted(synced) == sorted(f.root for f in manifest.files) == _blobs(tmp_path / "s")


def test_a_batch_whose_sync_fails_leaves_no_unsynced_blob_and_no_ref(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    def failing(path: Path) -> None:
        raise OSError(errno.EIO, "injected: the disk failed a sync", str(path))

    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    monkeypatch.setattr(durable, "_fsync_path", failing)
    with pytest.raises(OSError, match="injected"):
        store.stage(store_adapters["a"], "x")
    assert _blobs(tmp_path / "s") == [] and not os.listdir(tmp_path / "s" / "refs")
    monkeypatch.undo()
    manifest = store.stage(store_adapters["a"], "x")  # the same bytes again: installed and synced anew, whole
    assert store.verify("x") == manifest and _blobs(tmp_path / "s") == sorted(f.root for f in manifest.files)
