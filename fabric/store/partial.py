"""Peer downloads: a sparse file per adapter digest, each chunk verified before it is written, committed atomically."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from adapter_fabric.errors import AdapterNotFound, FabricError, IntegrityError, InvalidArgument
from adapter_fabric.store.catalog import Catalog, is_digest
from adapter_fabric.store.committer import Committer
from adapter_fabric.store.digests import chunk_digest
from adapter_fabric.store.durable import fsync_dir, fsync_file
from adapter_fabric.store.files import WRITEBACK_RUN, check_header, has_data, lock_held_dir, pread_exact, pwrite_all, start_writeback, write_stamp
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.lock_watch import WatchedLock
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.stamps import FileStamp
from adapter_fabric.store.tenants import TenantQuotas, TenantReservation


class Partials:
    """The peer downloads of one store: opened by digest, one object per digest while it is open."""

    def __init__(self, catalog: Catalog, committer: Committer, quota: Quota, tenants: TenantQuotas) -> None:
        self.catalog = catalog
        self.committer = committer
        self.quota = quota
        self.tenants = tenants
        self._lock = WatchedLock("partial downloads registry")  # guards _open; never held while waiting on the store's lock
        self._open: dict[str, PartialDownload] = {}

    def open(self, manifest: Manifest) -> PartialDownload:
        """The download of ``manifest``'s weights, keyed by digest; resumes what an earlier one left verified."""
        with self._lock:
            current = self._open.get(manifest.digest)
            if current is not None:
                if current.manifest.weights != manifest.weights:
                    raise InvalidArgument(
                        f"partial download of {manifest.digest} is open with chunk size {current.manifest.weights.chunk_size}, "
                        f"asked for {manifest.weights.chunk_size}"
                    )
                return current
            # The tenant's quota before the store's (which may evict), even for a reference to bytes already here: one more id.
            what = f"downloading {manifest.adapter_id!r}"
            tenant = self.tenants.reserve(manifest.adapter_id, {f.root: f.size for f in manifest.files}, what, writes=manifest.digest)
            try:
                return self._open_reserved(manifest, tenant, what)
            except BaseException:
                tenant.release()
                raise

    def _open_reserved(self, manifest: Manifest, tenant: TenantReservation, what: str) -> PartialDownload:
        """``open`` once the tenant's room is held (under ``_lock``); the download releases ``tenant`` when it ends."""
        if self.catalog.complete(manifest.digest) is not None:
            return PartialDownload(manifest, None, None, self.committer, self._forget, tenant)
        self.quota.check_manifest_limits(manifest)
        directory = self.committer.layout.partials / manifest.digest
        if not (directory / "manifest.json").is_file():
            self.quota.check_room(self.catalog.missing_bytes(manifest), what)
        lock_fd = lock_held_dir(directory, f"partial download of {manifest.digest}")
        try:
            if self.catalog.complete(manifest.digest) is not None:  # another process committed it meanwhile
                os.close(lock_fd)
                return PartialDownload(manifest, None, None, self.committer, self._forget, tenant)
            partial = PartialDownload(manifest, directory, lock_fd, self.committer, self._forget, tenant)
        except BaseException:
            os.close(lock_fd)
            raise
        self._open[manifest.digest] = partial
        return partial

    def refer(self, manifest: Manifest) -> Manifest:
        """Point ``manifest.adapter_id`` at its digest's bytes, committed here already (a second id, or a download another
        caller finished); ``AdapterNotFound`` when they left meanwhile (an unstage, an eviction), nothing changed.

        Opens no download: one another pull has under way for the digest is never touched (``open`` hands back the one
        open, and closing it there cut that pull with "partial download ... was closed or discarded").
        """
        tenant = self.tenants.reserve(manifest.adapter_id, {f.root: f.size for f in manifest.files}, f"downloading {manifest.adapter_id!r}")
        try:
            self.committer.require_ref(manifest)
        finally:
            tenant.release()
        return manifest

    def find(self, digest: str) -> PartialDownload | None:
        """The download of ``digest`` open in this store object, if any (to answer Availability and serve its verified chunks):
        one dict read (atomic), so Availability answers from the event loop and never waits on an ``open``'s disk work."""
        return self._open.get(digest)

    def left_for(self, digest: str) -> str:
        """The id a download of ``digest`` left in the store to resume is for (its ``manifest.json``); "" when none."""
        if not is_digest(digest):
            return ""
        try:
            return str(json.loads((self.committer.layout.partials / digest / "manifest.json").read_bytes()).get("adapter_id", ""))
        except (OSError, ValueError, AttributeError):
            return ""

    def _forget(self, digest: str) -> None:
        with self._lock:
            self._open.pop(digest, None)


class PartialDownload:
    """The weights file of one adapter digest, arriving chunk by chunk; each chunk is verified before it is written.

    Progress is the data itself: reopening re-hashes what is on disk, so a chunk counts as verified only if its bytes
    match. Nothing is synced while chunks arrive (an fdatasync per 1 MiB chunk cost ~100 ms of an 84 MB pull): each
    8 MiB block's writeback starts once its chunks are in, the commit's one sync round has little left, ``close`` syncs
    what a resume needs, and a chunk a power cut loses is fetched again. Once committed, reads come from the blob.

    The whole file is verified once every chunk is (digest scheme 2: the
    manifest's root is built over the chunk digests), so commit re-reads
    nothing, as long as only this object wrote the file (its directory is
    flock'ed). A change by anyone else is caught:

    - at ``commit``, when the file's ctime, mtime or size differ from what
      they were after this object's last write, or did before any later one
      (each write compares first): every chunk is then re-read and re-verified
      (ctime cannot be set back from user space; a change in the same
      timestamp tick as our own write is the case this misses; kernels since
      6.13 use fine-grained ctimes once observed, as we do after every write);
    - always on a reopen (resume), which re-hashes every chunk on disk.

    ``sink``: an object whose ``add(index, data)`` sees every chunk once it is
    verified and written (from the same buffer), e.g. a slot row staged while
    the bytes arrive (``adapter_fabric.serving.row_sink``); chunks verified before the
    sink was attached are read back for it once, by ``attach``.

    Not covered, here or for committed blobs: the device corrupting bytes
    below the page cache (``AdapterStore.verify`` re-reads a blob).
    """

    def __init__(
        self, manifest: Manifest, directory: Path | None, lock_fd: int | None, committer: Committer, forget: Callable[[str], None],
        tenant: TenantReservation | None = None,
    ) -> None:
        """``directory`` None: the digest is committed already (reads come from its blob). ``forget``: tell the registry it
        closed. ``tenant``: the room its tenant's quota holds for it, released when the download ends (committed, closed or discarded)."""
        self.manifest = manifest
        self._tenant = tenant
        self._committer = committer
        self._forget = forget
        self._lock = WatchedLock("partial download")
        self._directory = directory
        self._lock_fd = lock_fd
        self._fd: int | None = None
        weights = manifest.weights
        self._verified = bytearray(weights.chunk_count)
        self._prefix = 0  # chunks [0, _prefix) are all verified
        self._sinks: list = []
        self._written_stamp: FileStamp | None = None  # after our last write (adapter_fabric.store.stamps)
        self._changed_behind = False  # another writer changed the file between two of ours: commit re-verifies all
        # Writeback is started per WRITEBACK_RUN-aligned block once all its chunks are verified: chunks land in
        # any order (a swarm plan starts its runs at random chunks), so the verified prefix may stay short.
        self._block_chunks = max(1, WRITEBACK_RUN // weights.chunk_size)
        self._block_missing = [min(self._block_chunks, weights.chunk_count - b) for b in range(0, weights.chunk_count, self._block_chunks)]
        self._manifest_json = manifest.to_json() if directory is not None else b""  # once: reused at commit
        if directory is None:
            self._verified[:] = b"\1" * weights.chunk_count
            self._prefix = weights.chunk_count
        else:
            self._open_data()

    # ------------------------------------------------------------ opening

    @property
    def _open_fd(self) -> int:
        """The data file's descriptor; only called while the writer is open (``close`` sets it to None)."""
        assert self._fd is not None
        return self._fd

    @property
    def _open_directory(self) -> Path:
        """The partial's directory; only called before the commit moved its bytes into blobs/ (then it is None)."""
        assert self._directory is not None
        return self._directory

    def _open_data(self) -> None:
        weights = self.manifest.weights
        stored = self._open_directory / "manifest.json"
        if not stored.is_file() or stored.read_bytes() != self._manifest_json:
            # Whole or absent, not synced here (a file and a directory sync on every pull): only a resume reads it; ``close`` syncs it.
            self._committer.temps.replace(stored, self._manifest_json)
        self._fd = os.open(self._open_directory / "data", os.O_RDWR | os.O_CREAT, 0o644)
        # Sparse, not fallocate'd (measured ~6 ms faster per 80 MB): chunks may land in any
        # order, a resume skips the holes, and the disk blocks held show the progress.
        if os.fstat(self._open_fd).st_size != weights.size:
            os.ftruncate(self._open_fd, weights.size)
        for index in range(weights.chunk_count):
            offset, length = weights.chunk_span(index)
            if has_data(self._open_fd, offset, length):
                data = pread_exact(self._open_fd, length, offset, f"partial {self.manifest.digest}")
                if chunk_digest(data) == weights.chunk_digests[index]:
                    self._verified[index] = 1
                    self._block_missing[index // self._block_chunks] -= 1  # on disk already: no writeback to start
        self._advance()
        self._stamp()

    def _advance(self) -> None:
        while self._prefix < len(self._verified) and self._verified[self._prefix]:
            self._prefix += 1

    def _stamp(self) -> None:
        self._written_stamp = write_stamp(self._open_fd)

    def _read_back(self, index: int) -> bytes:
        offset, length = self.manifest.weights.chunk_span(index)
        return pread_exact(self._open_fd, length, offset, f"partial {self.manifest.digest}")

    # ------------------------------------------------------------ state

    @property
    def committed(self) -> bool:
        return self._directory is None

    @property
    def verified_offset(self) -> int:
        """The end of the contiguous verified prefix of the weights file."""
        weights = self.manifest.weights
        return weights.size if self._prefix == weights.chunk_count else self._prefix * weights.chunk_size

    @property
    def verified_chunks(self) -> set[int]:
        return {i for i, done in enumerate(self._verified) if done}

    @property
    def verified_bitmap(self) -> bytes:
        """Bit i (LSB first in byte i // 8) set = chunk i verified, as AvailabilityResponse carries it."""
        bitmap = bytearray((len(self._verified) + 7) // 8)
        for index, done in enumerate(self._verified):
            if done:
                bitmap[index // 8] |= 1 << (index % 8)
        return bytes(bitmap)

    @property
    def complete(self) -> bool:
        return self._prefix == len(self._verified)

    # ------------------------------------------------------------ chunks

    def attach(self, sink) -> None:
        """Give ``sink.add(index, data)`` every verified chunk from now on, and the ones verified already (read back once)."""
        with self._lock:
            self._require_open()
            for index in range(len(self._verified)):
                if self._verified[index]:
                    sink.add(index, self._read_back(index))
            self._sinks.append(sink)

    def detach(self, sink) -> None:
        """Stop feeding ``sink`` (its pull ended)."""
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def write_chunk(self, index: int, data: bytes | memoryview) -> None:
        """Verify chunk ``index`` against the manifest, then write it; a bad chunk writes nothing.

        ``data`` is written as given (a memoryview is not copied), and handed
        from the same buffer to the attached sinks.
        """
        self.manifest.weights.verify_chunk(index, data)  # outside the lock: workers verify in parallel
        with self._lock:
            if self._verified[index]:
                return
            self._require_open()
            offset = index * self.manifest.weights.chunk_size
            self._changed_behind |= write_stamp(self._open_fd) != self._written_stamp  # else our stamp would hide it
            pwrite_all(self._open_fd, data, offset)  # no fdatasync per chunk: see the class docstring
            self._stamp()
            self._verified[index] = 1
            self._advance()
            self._start_writeback(index)
            sinks = tuple(self._sinks)
        for sink in sinks:  # outside the lock: a row copy must not hold up other workers' writes
            sink.add(index, data)

    def _start_writeback(self, index: int) -> None:
        """Chunk ``index`` was just written: start writeback of its block once every chunk of the block is in."""
        block = index // self._block_chunks
        self._block_missing[block] -= 1
        if self._block_missing[block] == 0:
            weights = self.manifest.weights
            begin = block * self._block_chunks * weights.chunk_size
            start_writeback(self._open_fd, begin, min(weights.size, begin + self._block_chunks * weights.chunk_size) - begin)

    def read_chunk(self, index: int) -> bytes:
        """A verified chunk (re-checked on read: it may be served to other peers)."""
        weights = self.manifest.weights
        offset, length = weights.chunk_span(index)
        with self._lock:
            if not self._verified[index]:
                raise InvalidArgument(f"chunk {index} (offset {offset}) of {self.manifest.digest} is not verified here yet")
            self._require_open()  # a closed partial has no fd: say so, rather than a TypeError from pread
            if self._directory is None:
                with open(self._committed_blob(weights.root), "rb") as handle:
                    handle.seek(offset)
                    data = handle.read(length)
            else:
                data = pread_exact(self._open_fd, length, offset, f"partial {self.manifest.digest}")
        weights.verify_chunk(index, data)
        return data

    def open_unchanged(self, wait: bool = True) -> BinaryIO | None:
        """The data file, opened to ``sendfile`` verified chunks from; None when it may have changed on disk since our
        last write (its stamp, as ``commit`` checks it): ``read_chunk`` then re-reads and re-verifies each. Each receiver
        verifies every chunk too (a bad one is a corrupt chunk from this peer there). A commit (a rename) or a discard
        under a stream leaves the file readable: its chunks were verified either way. ``wait=False``: ``BlockingIOError`` while a write holds the lock."""
        with self._lock if wait else self._lock.if_free():
            self._require_open()
            unchanged = self._directory is not None and not self._changed_behind and write_stamp(self._open_fd) == self._written_stamp
            return open(self._open_directory / "data", "rb") if unchanged else None

    # ------------------------------------------------------------ finishing

    def commit(self, adapter_id: str) -> Manifest:
        """Whole-file check (cheap: see the class docstring), then blobs, manifest and ref; the partial is gone afterwards."""
        validate_adapter_id(adapter_id)
        manifest = self.manifest.with_id(adapter_id)
        with self._lock:
            if self._directory is None:
                try:
                    self._committer.require_ref(manifest)
                finally:
                    self._release_tenant()
                return manifest
            self._require_open()
            self._check_complete()
            try:
                self._check_whole_file()
            except FabricError:
                self._discard_locked()
                raise
            data_path = self._open_directory / "data"
            sources = {manifest.files[0].root: self._committer.temps.blob(manifest.config_json, sync=False), manifest.weights.root: data_path}
            try:
                same = manifest is self.manifest  # with_id returns self for the same id; to_json covers the id
                # Both files' bytes are synced in the commit's one round, beside its manifest and ref, before a ref names them.
                self._committer.commit(manifest, adapter_id, sources, manifest_json=self._manifest_json if same else None, unsynced=frozenset(sources))
            finally:
                sources[manifest.files[0].root].unlink(missing_ok=True)
            self._close_locked(remove=True)
        return manifest

    def _committed_blob(self, root: str) -> Path:
        path = self._committer.layout.blob(root)
        if not path.is_file():
            raise AdapterNotFound(f"no committed file with root {root} in this store")
        return path

    def _check_complete(self) -> None:
        if self.complete:
            return
        missing, weights = len(self._verified) - sum(self._verified), self.manifest.weights
        raise InvalidArgument(f"partial download of {self.manifest.digest} is incomplete: {missing} of {weights.chunk_count} chunks "
                              f"missing, first is chunk {self._prefix} at offset {self._prefix * weights.chunk_size}")

    def _check_whole_file(self) -> None:
        """Every chunk is verified, so the file is, unless someone else changed it since our last write: then re-verify each chunk."""
        if self._changed_behind or write_stamp(self._open_fd) != self._written_stamp:
            weights = self.manifest.weights
            for index in range(weights.chunk_count):
                try:
                    weights.verify_chunk(index, self._read_back(index))
                except IntegrityError as exc:
                    raise IntegrityError(
                        f"partial download of {self.manifest.digest}: the file was changed on disk after its chunks were verified: {exc}"
                    ) from None
        check_header(self.manifest, self._open_directory / "data")

    def _require_open(self) -> None:
        if self._directory is not None and self._fd is None:
            raise InvalidArgument(f"partial download of {self.manifest.digest} was closed or discarded")

    def discard(self) -> None:
        """Drop the partial and its bytes (a committed adapter is not touched)."""
        with self._lock:
            self._discard_locked()
            self._release_tenant()

    def _discard_locked(self) -> None:
        if self._directory is not None and self._fd is not None:
            self._close_locked(remove=True, committed=False)

    def close(self) -> None:
        """Let go of the partial, keeping its verified bytes on disk (synced) for a later resume."""
        with self._lock:
            if self._directory is not None and self._fd is not None:
                try:  # a failed sync still closes (and is raised): a resume re-hashes what is on disk, and rewrites a lost note
                    os.fdatasync(self._open_fd)
                    if (note := self._open_directory / "manifest.json").is_file():
                        fsync_file(note)
                    fsync_dir(self._open_directory)
                finally:
                    self._close_locked(remove=False, committed=False)
            self._release_tenant()

    def _close_locked(self, remove: bool, committed: bool = True) -> None:
        if remove:
            shutil.rmtree(self._open_directory, ignore_errors=True)
        assert self._lock_fd is not None  # held from open to here
        os.close(self._open_fd)
        os.close(self._lock_fd)
        self._fd = self._lock_fd = None
        if committed:
            self._directory = None  # from now on reads come from the blob
        self._forget(self.manifest.digest)
        self._release_tenant()

    def _release_tenant(self) -> None:
        if self._tenant is not None:
            self._tenant.release()
