"""A peer download's one verification pass (digest scheme 2), and what it guarantees.

Every chunk is checked against its digest as it lands, and the manifest's
root is built over those digests, so a partial's commit re-reads nothing.
These tests pin down that this still covers the bytes on disk: chunks in any
order, a resume, a data file changed behind the partial's back after its
chunks were verified (caught at commit, or by the re-hash on reopen), and the
sinks that see each verified chunk from the buffer it was written from.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from pathlib import Path

import pytest

from tests.support.store import corrupt_behind_the_writer, snapshot
from adapter_fabric.errors import IntegrityError, InvalidArgument
from adapter_fabric.store.lock_watch import held_now
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, Manifest, build_manifest
from adapter_fabric.store import AdapterStore

CHUNK = 1024  # ~6 chunks of the ~6 KB adapter "c"


@pytest.fixture(scope="module")
def adapter(store_adapters: dict[str, Path]) -> tuple[Path, Manifest]:
    directory = store_adapters["c"]
    manifest = build_manifest("c", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, CHUNK)
    assert manifest.weights.chunk_count >= 4, "the tests need several chunks"
    return directory, manifest


def _chunks(directory: Path, manifest: Manifest) -> list[bytes]:
    data = (directory / WEIGHTS_FILE).read_bytes()
    return [data[o : o + n] for o, n in map(manifest.weights.chunk_span, range(manifest.weights.chunk_count))]


def _committed(root: Path) -> dict[str, str]:
    return {k: v for k, v in snapshot(root).items() if k.split("/")[0] in ("blobs", "manifests", "refs", "views")}


# ---------------------------------------------------------------- in a partial download


def test_chunks_in_any_order_commit_the_exact_file(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    order = list(range(len(chunks)))
    random.Random(7).shuffle(order)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    partial = store.open_partial(manifest)
    for index in order:
        partial.write_chunk(index, memoryview(chunks[index]))  # as the wire hands them over: views, no copy
    partial.commit("c")
    assert store.blob_path(manifest.weights.root).read_bytes() == (directory / WEIGHTS_FILE).read_bytes()
    assert store.verify("c").digest == manifest.digest


def test_a_resumed_partial_hashes_what_it_found_and_commits(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    last = len(chunks) - 1
    first = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    for index in (0, 1, last):
        first.write_chunk(index, chunks[index])
    first.close()  # the reopen re-hashes what is on disk
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    resumed = store.open_partial(manifest)
    assert resumed.verified_chunks == {0, 1, last}
    for index in range(2, last):
        resumed.write_chunk(index, chunks[index])
    assert resumed.commit("c").digest == manifest.digest
    assert store.verify("c").digest == manifest.digest


def test_a_file_changed_on_disk_after_its_chunks_were_verified_is_caught_at_commit(tmp_path: Path, adapter) -> None:
    """Each chunk was verified as it landed; the commit notices the file changed since (ctime) and re-verifies every chunk."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    before = _committed(tmp_path)
    partial = store.open_partial(manifest)
    for index, chunk in enumerate(chunks):
        partial.write_chunk(index, chunk)
    corrupt_behind_the_writer(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)  # chunk 1, verified and hashed
    with pytest.raises(IntegrityError, match="changed on disk after its chunks were verified"):
        partial.commit("c")
    assert _committed(tmp_path) == before and store.list() == []
    assert list((tmp_path / "partial").iterdir()) == [], "a partial that failed its whole-file check is dropped"


def test_a_change_between_two_of_the_writers_own_writes_is_still_caught_at_commit(tmp_path: Path, adapter) -> None:
    """The stamp is taken after each write: a stray writer's change before the next chunk's write would be hidden by
    that write's new stamp, so each write first compares the stamp it left last time."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    before = _committed(tmp_path)
    partial = store.open_partial(manifest)
    partial.write_chunk(0, chunks[0])
    partial.write_chunk(1, chunks[1])
    corrupt_behind_the_writer(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)  # chunk 1, already verified
    for index in range(2, len(chunks)):
        partial.write_chunk(index, chunks[index])  # each write leaves a fresh stamp behind it
    assert partial.open_unchanged() is None, "never sent unchecked to a peer"
    with pytest.raises(IntegrityError, match="changed on disk after its chunks were verified: .*chunk 1"):
        partial.commit("c")
    assert _committed(tmp_path) == before and store.list() == []


def test_verified_chunks_are_served_from_the_file_until_it_changes_on_disk_then_each_is_re_verified(tmp_path: Path, adapter) -> None:
    """A peer is served a partial's verified chunks from its file (sendfile, no re-hash) while the file is as this
    object last wrote it; once another writer changed it, serving re-reads and re-verifies each chunk, and refuses the
    changed one (a change the stamp cannot see is a corrupt chunk at the receiver: test_corrupt_chunk_on_the_wire_is_refetched)."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    partial = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    for index in (0, 1, 2):
        partial.write_chunk(index, chunks[index])
    with partial.open_unchanged() as served:
        assert [served.read(CHUNK) for _ in range(3)] == chunks[:3]
    corrupt_behind_the_writer(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)  # chunk 1
    assert partial.open_unchanged() is None, "a file changed behind the writer is never sent unchecked"
    assert partial.read_chunk(0) == chunks[0]
    with pytest.raises(IntegrityError, match="chunk 1"):
        partial.read_chunk(1)
    partial.discard()
    with pytest.raises(InvalidArgument, match="closed or discarded"):
        partial.open_unchanged()


def test_the_event_loop_opens_an_unchanged_partial_without_waiting_and_is_told_when_a_write_holds_its_lock(tmp_path: Path, adapter) -> None:
    """``open_unchanged(wait=False)``: the data channel opens a partial's file on its event loop (no thread hop per
    request) when no write holds the partial's lock, and hears BlockingIOError at once when one does (it then waits on a
    thread); the lock is noted while held, as every store lock is (invariant 17), and free again after."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    partial = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    partial.write_chunk(0, chunks[0])
    with partial.open_unchanged(wait=False) as served:
        assert served.read(CHUNK) == chunks[0]
    assert held_now() == ()
    taken, done = threading.Event(), threading.Event()

    def writer_holds_the_lock() -> None:
        with partial._lock:
            taken.set()
            done.wait(30)

    holder = threading.Thread(target=writer_holds_the_lock)
    holder.start()
    try:
        assert taken.wait(30)
        with pytest.raises(BlockingIOError, match="partial download"):
            partial.open_unchanged(wait=False)
        assert held_now() == ()
    finally:
        done.set()
        holder.join(30)
    with partial.open_unchanged(wait=False) as served:  # free again
        assert served.read(CHUNK) == chunks[0]
    with partial._lock.if_free():
        assert held_now() == ("partial download",)
    assert held_now() == ()


def test_a_stream_keeps_reading_verified_chunks_from_a_partial_committed_or_discarded_under_it(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    partial = store.open_partial(manifest)
    for index, chunk in enumerate(chunks):
        partial.write_chunk(index, chunk)
    with partial.open_unchanged() as served:
        partial.commit("c")  # renames the file into blobs/: the open file is the same one
        assert served.read() == b"".join(chunks)
        assert partial.open_unchanged() is None, "a committed download is served as a blob, verified at rest"
    second = AdapterStore(tmp_path / "other", chunk_size=CHUNK).open_partial(manifest)
    second.write_chunk(0, chunks[0])
    with second.open_unchanged() as served:
        second.discard()
        assert served.read(CHUNK) == chunks[0]


def test_a_file_changed_on_disk_while_open_is_caught_by_the_resume_re_hash(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    partial = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    for index in (0, 1, 2):
        partial.write_chunk(index, chunks[index])
    corrupt_behind_the_writer(tmp_path / "partial" / manifest.digest / "data", CHUNK + 3)
    partial.close()
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    resumed = store.open_partial(manifest)
    assert resumed.verified_chunks == {0, 2}, "the changed chunk no longer counts as verified"
    for index in range(1, len(chunks)):
        resumed.write_chunk(index, chunks[index])  # chunk 1 is fetched again and rewritten
    assert resumed.commit("c").digest == manifest.digest
    assert store.verify("c").digest == manifest.digest


class _Recorder:
    """A sink that keeps what it was handed."""

    def __init__(self) -> None:
        self.seen: dict[int, bytes] = {}

    def add(self, index: int, data) -> None:
        assert index not in self.seen, f"chunk {index} handed to the sink twice"
        self.seen[index] = bytes(data)


def test_a_sink_sees_every_verified_chunk_once_including_those_found_on_resume(tmp_path: Path, adapter) -> None:
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    first = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    first.write_chunk(1, chunks[1])
    first.close()
    partial = AdapterStore(tmp_path, chunk_size=CHUNK).open_partial(manifest)
    sink = _Recorder()
    partial.attach(sink)
    assert sink.seen == {1: chunks[1]}, "a chunk verified before the sink was attached is read back for it"
    bad = bytearray(chunks[0])
    bad[0] ^= 1
    with pytest.raises(IntegrityError):
        partial.write_chunk(0, bytes(bad))
    assert 0 not in sink.seen, "a chunk that fails verification never reaches a sink"
    for index in range(len(chunks)):
        partial.write_chunk(index, memoryview(chunks[index]))  # chunk 1 again: already verified, not handed twice
    assert sink.seen == dict(enumerate(chunks))
    partial.detach(sink)
    partial.commit("c")


# ---------------------------------------------------------------- the header against the manifest


def test_a_manifest_whose_tensor_index_disagrees_with_the_files_header_is_refused_at_commit(tmp_path: Path, adapter) -> None:
    """Two tensors of one shape with their offsets swapped: every chunk verifies (the bytes are the file's), and the
    manifest is consistent in itself, but it would put each tensor's bytes under the other's name."""
    directory, manifest = adapter
    chunks = _chunks(directory, manifest)
    by_shape: dict[tuple, list[int]] = {}
    for i, t in enumerate(manifest.tensors):
        by_shape.setdefault((t.dtype, t.shape), []).append(i)
    i, j = next(pair[:2] for pair in by_shape.values() if len(pair) > 1)
    tensors = list(manifest.tensors)
    a, b = tensors[i], tensors[j]
    tensors[i], tensors[j] = dataclasses.replace(a, begin=b.begin, end=b.end), dataclasses.replace(b, begin=a.begin, end=a.end)
    lying = dataclasses.replace(manifest, tensors=tuple(sorted(tensors, key=lambda t: t.begin)))
    store = AdapterStore(tmp_path, chunk_size=CHUNK)
    before = _committed(tmp_path)
    partial = store.open_partial(lying)
    for index, chunk in enumerate(chunks):
        partial.write_chunk(index, chunk)
    with pytest.raises(IntegrityError, match="the safetensors header differs from the tensor index in its manifest"):
        partial.commit("c")
    assert _committed(tmp_path) == before and store.list() == []
