"""The whole-file sha256 of a peer download, computed as chunks land (fabric.store.ordered_hash), and what it guarantees.

A partial's commit checks the whole file against the manifest without
re-reading it, from a running hash over the chunks as written. These tests
pin down that this still covers the bytes on disk: chunks in any order, held
or read back, a resume, and a data file changed behind the partial's back
after its chunks were verified (caught at commit, or by the re-hash on reopen).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path

import pytest

from _store_helpers import make_adapters, snapshot
from fabric.errors import IntegrityError
from fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, Manifest, build_manifest
from fabric.store.ordered_hash import InOrderHasher
from fabric.store import AdapterStore, PartialDownload

CHUNK = 1024  # ~6 chunks of the ~6 KB adapter "c"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    directory = make_adapters(tmp_path_factory.mktemp("adapters"))["c"]
    manifest = build_manifest("c", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, CHUNK)
    assert manifest.weights.chunk_count >= 4, "the tests need several chunks"
    return directory, manifest


def _chunks(directory: Path, manifest: Manifest) -> list[bytes]:
    data = (directory / WEIGHTS_FILE).read_bytes()
    return [data[o : o + n] for o, n in map(manifest.weights.chunk_span, range(manifest.weights.chunk_count))]


def _committed(root: Path) -> dict[str, str]:
    return {k: v for k, v in snapshot(root).items() if k.split("/")[0] in ("blobs", "manifests", "refs", "views")}


def _corrupt_on_disk(data_path: Path, offset: int) -> None:
    """Flip a byte through another descriptor, as a stray writer (or a bad disk tool) would, until the ctime moves."""
    before = data_path.stat().st_ctime_ns
    with open(data_path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        for _ in range(200):  # a coarse-clock kernel may need a tick to pass before the ctime changes
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
            handle.flush()
            if os.fstat(handle.fileno()).st_ctime_ns != before:
                return
            time.sleep(0.005)
    pytest.skip("the data file's ctime did not move after a write (filesystem without ctime updates)")


# ---------------------------------------------------------------- InOrderHasher alone


@pytest.mark.parametrize("hold_bytes", [0, 3, 1 << 20])
def test_in_order_hasher_gives_the_file_digest_for_any_arrival_order(hold_bytes: int) -> None:
    chunks = [os.urandom(random.Random(i).randrange(1, 50)) for i in range(40)]
    for seed in range(5):
        order = list(range(len(chunks)))
        random.Random(seed).shuffle(order)
        written: set[int] = set()
        hasher = InOrderHasher(len(chunks), written.__contains__, chunks.__getitem__, hold_bytes)
        for index in order:
            written.add(index)
            hasher.add(index, chunks[index])
            hasher.add(index, chunks[index])  # a duplicate (endgame) is folded in once
        assert hasher.finish() == hashlib.sha256(b"".join(chunks)).hexdigest()
        assert hasher.from_memory >= 1


def test_in_order_hasher_never_holds_a_buffer_that_may_change() -> None:
    """A view of a reused receive buffer is read back from the file, not hashed from memory later."""
    chunks = [b"a" * 8, b"b" * 8, b"c" * 8]
    written: set[int] = set()
    hasher = InOrderHasher(3, written.__contains__, chunks.__getitem__)
    buffer = bytearray(chunks[2])
    written.add(2)
    hasher.add(2, memoryview(buffer))
    buffer[:] = b"x" * 8  # the buffer is reused for the next message
    for index in (0, 1):
        written.add(index)
        hasher.add(index, chunks[index])
    assert hasher.finish() == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_in_order_hasher_refuses_to_finish_with_a_gap() -> None:
    chunks = [b"a", b"b"]
    hasher = InOrderHasher(2, {0}.__contains__, chunks.__getitem__)
    hasher.add(0, chunks[0])
    with pytest.raises(ValueError, match="chunk 1 of 2 is not written"):
        hasher.finish()


# ---------------------------------------------------------------- in a partial download


@pytest.mark.parametrize("hold_bytes", [0, 1 << 20])
def test_chunks_in_any_order_commit_the_exact_file(tmp_path: Path, adapter, monkeypatch, hold_bytes: int) -> None:
    directory, manifest = adapter
    monkeypatch.setattr(PartialDownload, "hold_bytes", hold_bytes)
    chunks = _chunks(directory, manifest)
    order = list(range(len(chunks)))
    random.Random(7).shuffle(order)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    partial = store.open_partial(manifest)
    for index in order:
        partial.write_chunk(index, memoryview(chunks[index]))  # as the wire hands them over: views, no copy
    partial.commit("c")
    assert store.blob_path(manifest.weights.sha256).read_bytes() == (directory / WEIGHTS_FILE).read_bytes()
    assert store.verify("c").digest == manifest.digest


def test_a_resumed_partial_hashes_what_it_found_and_commits(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    last = len(chunks) - 1
    first = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    for index in (0, 1, last):
        first.write_chunk(index, chunks[index])
    first.close()  # the hasher state is gone with the process; the reopen re-hashes what is on disk
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    resumed = store.open_partial(manifest)
    assert resumed.verified_chunks == {0, 1, last}
    for index in range(2, last):
        resumed.write_chunk(index, chunks[index])
    assert resumed.commit("c").digest == manifest.digest
    assert store.verify("c").digest == manifest.digest


def test_a_file_changed_on_disk_after_its_chunks_were_verified_is_caught_at_commit(tmp_path: Path, adapter) -> None:
    """The running hash saw the good bytes; the commit notices the file changed since (ctime) and re-reads it."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    before = _committed(tmp_path)
    partial = store.open_partial(manifest)
    for index, chunk in enumerate(chunks):
        partial.write_chunk(index, chunk)
    _corrupt_on_disk(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)  # chunk 1, verified and hashed
    with pytest.raises(IntegrityError, match="changed on disk after its chunks were verified"):
        partial.commit("c")
    assert _committed(tmp_path) == before and store.list() == []
    assert list((tmp_path / "partial").iterdir()) == [], "a partial that failed its whole-file check is dropped"


def test_a_file_changed_on_disk_while_open_is_caught_by_the_resume_re_hash(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    partial = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    for index in (0, 1, 2):
        partial.write_chunk(index, chunks[index])
    _corrupt_on_disk(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)
    partial.close()
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    resumed = store.open_partial(manifest)
    assert resumed.verified_chunks == {0, 2}, "the changed chunk no longer counts as verified"
    for index in range(1, len(chunks)):
        resumed.write_chunk(index, chunks[index])  # chunk 1 is fetched again and rewritten
    assert resumed.commit("c").digest == manifest.digest
    assert store.verify("c").digest == manifest.digest
