"""Issue 34: a commit's blob bytes are synced in its batch's one file round (not one sync each before the commit), and a
batch whose syncs fail leaves no unsynced blob in place for a later commit of the same bytes to take as durable. A peer
download's two files too (its data and config); its resume note (``manifest.json``) is synced when it closes.

Real stores on disk; the sync failure is injected into the store's one path-sync helper (a disk that fails its fsync).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from adapter_fabric.store import AdapterStore, durable
from adapter_fabric.store import partial as partial_module
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, build_manifest
from tests.support.store import SMALL_CHUNK


def _blobs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "blobs" / "blake3").rglob("*") if p.is_file())


def _synced_before_ref(monkeypatch, ref: Path) -> list[str]:
    """The names of the files the store's path-sync helper syncs from now on, each checked to come before ``ref`` is placed."""
    synced: list[str] = []
    real = durable.fsync_file

    def sync(path: Path) -> None:
        assert not ref.exists(), "a ref was placed before its blob's bytes were synced"
        synced.append(path.name)
        real(path)

    monkeypatch.setattr(durable, "fsync_file", sync)
    return synced


def test_a_stage_syncs_its_blobs_in_the_batch_round_before_its_ref(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    synced = _synced_before_ref(monkeypatch, tmp_path / "s" / "refs" / "x")
    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    manifest = store.stage(store_adapters["a"], "x")
    assert sorted(synced) == sorted(f.root for f in manifest.files) == _blobs(tmp_path / "s")


def test_a_batch_whose_sync_fails_leaves_no_unsynced_blob_and_no_ref(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    def failing(path: Path) -> None:
        raise OSError(errno.EIO, "injected: the disk failed a sync", str(path))

    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    monkeypatch.setattr(durable, "fsync_file", failing)
    with pytest.raises(OSError, match="injected"):
        store.stage(store_adapters["a"], "x")
    assert _blobs(tmp_path / "s") == [] and not os.listdir(tmp_path / "s" / "refs")
    monkeypatch.undo()
    manifest = store.stage(store_adapters["a"], "x")  # the same bytes again: installed and synced anew, whole
    assert store.verify("x") == manifest and _blobs(tmp_path / "s") == sorted(f.root for f in manifest.files)


# ---------------------------------------------------------------- a peer download's commit and close


def _download(root: Path, directory: Path) -> tuple[AdapterStore, object, list[bytes]]:
    """A store with a partial download of ``directory``'s adapter open and every chunk written, not committed."""
    manifest = build_manifest("x", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, SMALL_CHUNK)
    data = (directory / WEIGHTS_FILE).read_bytes()
    chunks = [data[o : o + n] for o, n in map(manifest.weights.chunk_span, range(manifest.weights.chunk_count))]
    store = AdapterStore(root, chunk_size=SMALL_CHUNK)
    partial = store.open_partial(manifest)
    for index, chunk in enumerate(chunks):
        partial.write_chunk(index, chunk)
    return store, partial, chunks


def test_a_peer_download_syncs_both_its_files_in_the_commit_round_before_its_ref(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    store, partial, _ = _download(tmp_path / "s", store_adapters["a"])
    synced = _synced_before_ref(monkeypatch, tmp_path / "s" / "refs" / "x")
    manifest = partial.commit("x")
    assert sorted(synced) == sorted(f.root for f in manifest.files) == _blobs(tmp_path / "s")
    assert store.verify("x").digest == manifest.digest


def test_a_peer_download_whose_commit_sync_fails_leaves_no_blob_and_no_ref_and_pulls_again(
    tmp_path: Path, store_adapters: dict[str, Path], monkeypatch
) -> None:
    store, partial, chunks = _download(tmp_path / "s", store_adapters["a"])

    def failing(path: Path) -> None:
        raise OSError(errno.EIO, "injected: the disk failed a sync", str(path))

    monkeypatch.setattr(durable, "fsync_file", failing)
    with pytest.raises(OSError, match="injected"):
        partial.commit("x")
    monkeypatch.undo()
    assert _blobs(tmp_path / "s") == [] and not os.listdir(tmp_path / "s" / "refs")
    partial.discard()
    again = store.open_partial(partial.manifest)
    for index, chunk in enumerate(chunks):
        again.write_chunk(index, chunk)
    assert again.commit("x").digest == partial.manifest.digest
    assert store.verify("x").digest == partial.manifest.digest


def test_a_closed_download_leaves_its_manifest_synced_for_a_resume(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    store, partial, _ = _download(tmp_path / "s", store_adapters["a"])
    synced: list[str] = []
    real = durable.fsync_file
    monkeypatch.setattr(partial_module, "fsync_file", lambda path: (synced.append(path.name), real(path)))
    partial.close()
    assert synced == ["manifest.json"]
    resumed = store.open_partial(partial.manifest)
    assert resumed.complete and resumed.commit("x").digest == partial.manifest.digest


def test_a_download_closes_whatever_its_syncs_meet_and_resumes(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    """Its resume note gone (a resume writes it again), or a sync that fails (raised, but the download is closed all the
    same: not left open and unusable): the next open resumes from what is on disk and commits."""
    store, partial, _ = _download(tmp_path / "s", store_adapters["a"])
    (tmp_path / "s" / "partial" / partial.manifest.digest / "manifest.json").unlink()
    partial.close()
    again = store.open_partial(partial.manifest)
    assert again.complete

    def failing(path: Path) -> None:
        raise OSError(errno.EIO, "injected: the disk failed a sync", str(path))

    monkeypatch.setattr(partial_module, "fsync_dir", failing)
    with pytest.raises(OSError, match="injected"):
        again.close()
    monkeypatch.undo()
    resumed = store.open_partial(partial.manifest)
    assert resumed is not again and resumed.complete and resumed.commit("x").digest == partial.manifest.digest
