"""The one path by which anything becomes committed: blobs, then manifest, then ref, under the store's lock.

Every writer (staging from a directory, a client upload, a peer download, a
repair) hands its verified temp files to ``Committer.commit``; nothing else
writes into ``blobs/``, ``manifests/`` or ``refs/``. Each step is written to a
temp file, fsync'ed, renamed and its directory fsync'ed, so a reader that sees
a ref sees its manifest and its blobs. A crash leaves at most orphans (blobs
or manifests no ref reaches) and temp files, which recovery removes.

Group commit: concurrent ``commit`` calls (a bulk publish's many Stage
calls) are committed together. The first caller leads: it takes every commit
waiting (up to ``MAX_BATCH``), and under the lock installs each in turn
(room is checked against what the ones before it installed), then makes the
whole batch durable in the same order one commit uses, paying the syncs once
(``adapter_fabric.store.syncs``): every new file (manifests, refs) synced in one
round, then blobs and manifests renamed into place and their directories
synced, then the refs renamed and their directory synced. Every caller returns once its own
commit is durable, or raises its own error; one commit's refusal never fails
the others.

What follows a commit elsewhere (integrity stamps, the export directory) is
told through the ``CommitListener`` handed in, so the committer knows neither.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.durable import SYNC_THREADS, DeferredSyncs, TempFiles, fsync_dir
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.recovery import GarbageCollector
from adapter_fabric.store.store_lock import StoreLock

#: commits one leader makes durable together: bounds how long the last of a batch waits
MAX_BATCH = 256


class CommitListener(Protocol):
    """Told of each change the committer makes, under the store's lock: ``changing``, the changes, then ``changed``."""

    def changing(self) -> None:
        """The committer holds the store's lock and is about to change it."""

    def changed(self, whole: bool) -> None:
        """The committer is done with this hold of the lock (``whole`` False: a change failed part way)."""

    def blob_committed(self, root: str) -> None:
        """The verified bytes of ``root`` were just renamed into ``blobs/``."""

    def ref_set(self, adapter_id: str, digest: str) -> None:
        """``adapter_id`` now refers to ``digest`` (its manifest and blobs are committed)."""

    def ref_removed(self, adapter_id: str) -> None:
        """``adapter_id`` was unstaged."""


@dataclass(frozen=True)
class Commit:
    """One commit of a group (``Committer.commit_all``): verified temp files (root -> path), none of their bytes synced yet."""

    manifest: Manifest
    adapter_id: str
    sources: dict[str, Path]
    unsynced: frozenset[str]


@dataclass
class _Pending:
    """One caller's commit, waiting for a leader (maybe itself) to make it durable."""

    manifest: Manifest
    adapter_id: str
    sources: dict[str, Path]
    check_room: bool
    manifest_json: bytes | None
    unsynced: frozenset[str] = frozenset()
    existed: bool = False
    error: BaseException | None = None
    done: bool = False


class Committer:
    """Owns the store's lock and its commit order; every commit path goes through ``commit`` or ``commit_ref``."""

    def __init__(
        self,
        layout: StoreLayout,
        lock: StoreLock,
        temps: TempFiles,
        catalog: Catalog,
        collector: GarbageCollector,
        quota: Quota,
        listener: CommitListener,
    ) -> None:
        self.layout = layout
        self.lock = lock
        self.temps = temps
        self.catalog = catalog
        self.quota = quota
        self._collector = collector
        self._listener = listener
        self._group = threading.Condition()  # guards _waiting and _leading
        self._waiting: list[_Pending] = []
        self._leading = False
        self._syncs = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="store-sync")

    def commit(
        self, manifest: Manifest, adapter_id: str, sources: dict[str, Path], *, check_room: bool = False, manifest_json: bytes | None = None,
        unsynced: frozenset[str] = frozenset(),
    ) -> bool:
        """Install blobs (renaming ``sources``: root -> temp file), manifest, then ref. True if the digest was already here.

        ``manifest_json``: ``manifest.to_json()`` when the caller has it already (~0.6 ms for Llama-3-8B shapes).
        ``check_room``: re-check the store's limit under the lock; partials and uploads reserved their bytes
        when they opened, so only staging from a directory asks (another writer may have taken the room).
        ``unsynced``: the roots whose source files' bytes are not synced yet: the batch syncs them in its file round, with
        the manifests and refs (a bulk publish of small adapters pays no sync of its own per adapter).
        Returns once this commit is durable; concurrent calls share the syncs (group commit, module docstring).
        """
        job = _Pending(manifest, adapter_id, sources, check_room, manifest_json, unsynced)
        self._run([job])
        if job.error is not None:
            raise job.error
        return job.existed

    def commit_all(self, commits: list[Commit]) -> list[bool | BaseException]:
        """``commit`` of each of ``commits`` (at most ``MAX_BATCH``: one group when no one else commits meanwhile), queued
        together so one leader makes them durable at once (a StageMany batch). Each outcome in order: whether its digest
        was already here, or its own error (one refusal never fails the others)."""
        jobs = [_Pending(c.manifest, c.adapter_id, c.sources, False, None, c.unsynced) for c in commits]
        self._run(jobs)
        return [job.error if job.error is not None else job.existed for job in jobs]

    def _run(self, jobs: list[_Pending]) -> None:
        """Queue ``jobs`` and lead batches (or wait for the leader) until every one of them is done."""
        with self._group:
            self._waiting.extend(jobs)
        while True:
            with self._group:
                while self._leading and not all(job.done for job in jobs):
                    self._group.wait()
                if all(job.done for job in jobs):
                    return
                self._leading = True
                batch = self._waiting[:MAX_BATCH]
                del self._waiting[:MAX_BATCH]
            self._lead(batch)

    def _lead(self, batch: list[_Pending]) -> None:
        """Commit ``batch`` under the lock; whatever happens, every caller in it is woken with its outcome."""
        try:
            with self.lock.held(), self._telling():
                self._commit_batch(batch)
        except BaseException as exc:
            self._collector.live.invalidate()  # refs may be half written: the next collection reads them all
            for job in batch:
                if job.error is None:
                    job.error = exc  # the batch's syncs failed: none of it is known durable
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._group:
                for job in batch:
                    job.done = True
                self._leading = False
                self._group.notify_all()

    def _commit_batch(self, batch: list[_Pending]) -> None:
        """Each commit's blobs, manifest and ref written in turn (each room check sees the ones before); then, for the
        whole batch: every file synced (one round), blobs and manifests placed and their directories synced, refs last."""
        files, refs = DeferredSyncs(self.temps, self._syncs), DeferredSyncs(self.temps, self._syncs)
        written: list[_Pending] = []
        in_batch: dict[str, str] = {}  # id -> the digest this batch wrote for it last
        candidates: set[str] = set()  # digests an id left in this batch: collected if nothing refers to them after it
        try:
            for job in batch:
                try:
                    # A manifest whose blobs were quarantined (or whose file is damaged) is not "existed": this commit repairs it.
                    job.existed = self.catalog.complete(job.manifest.digest) is not None
                    if not job.existed:
                        self._install(job, files)
                    on_disk = self.catalog.read_ref(job.adapter_id)
                except Exception as exc:  # this commit's refusal (room, a vanished source): the others go on
                    job.error = exc
                    continue
                digest = job.manifest.digest
                # what the id refers to once the batch's earlier refs are placed: the last commit of an id wins
                previous = in_batch.get(job.adapter_id, on_disk)
                if previous != digest:
                    refs.write(self.layout.ref(job.adapter_id), digest.encode("ascii"))
                    # an id that referred to other bytes (before this batch, or earlier in it) may leave them unreferenced;
                    # a new id leaves nothing, so it collects nothing (nor asks another process's changes to be read)
                    candidates.update(d for d in (on_disk, previous) if d is not None and d != digest)
                    in_batch[job.adapter_id] = digest
                    written.append(job)
            files.sync_files(also=refs)
            files.place()  # blobs and manifests durable in place before any ref names them
            refs.place()
        finally:
            files.discard()
            refs.discard()
        live = self._collector.live
        for job in written:
            live.ref_set(job.adapter_id, job.manifest.digest, [f.root for f in job.manifest.files])
        if written:
            live.bump()
        for job in batch:
            if job.error is None:
                try:
                    self._listener.ref_set(job.adapter_id, job.manifest.digest)
                except Exception as exc:  # committed, but what follows failed (an export): this caller hears it
                    job.error = exc
        if candidates:
            self._collector.collect_digests(candidates)  # a previous digest no id refers to any more goes

    def _install(self, job: _Pending, files: DeferredSyncs) -> None:
        """One commit's blobs (renamed into place; their bytes were synced by their writer) and manifest (written, synced at flush)."""
        manifest = job.manifest
        if job.check_room:
            self.quota.check_room(self.catalog.missing_bytes(manifest), f"staging {job.adapter_id!r}")
        for entry in manifest.files:
            self._install_blob(entry.root, job.sources[entry.root], files, synced=entry.root not in job.unsynced)
        files.write(self.layout.manifest(manifest.digest), job.manifest_json or manifest.to_json())
        self.catalog.remember(manifest)

    def commit_ref(self, manifest: Manifest) -> bool:
        """Point ``manifest.adapter_id`` at its digest when every byte of it is committed already; False when it is not."""
        with self.lock.held(), self._telling():
            complete = self.catalog.complete(manifest.digest)
            if complete is None:
                return False
            self._set_ref(manifest.adapter_id, complete)
            return True

    def require_ref(self, manifest: Manifest) -> None:
        """``commit_ref``, or ``AdapterNotFound`` when the digest's bytes went meanwhile."""
        if not self.commit_ref(manifest):
            raise AdapterNotFound(
                f"the bytes of {manifest.digest} were removed from this store before {manifest.adapter_id!r} referred to them; pull again"
            )

    def remove_ref(self, adapter_id: str, only_digest: str | None = None) -> str | None:
        """Unstage ``adapter_id``; the digest it referred to (None when it was not staged). Unreferenced bytes go.

        ``only_digest``: unstage it only while it still refers to that digest (an eviction must not drop a version
        restaged since it chose its victim); None when it refers to another.
        """
        with self.lock.held(), self._telling():
            digest = self.catalog.read_ref(adapter_id)
            if digest is None or (only_digest is not None and digest != only_digest):
                return None
            self.layout.ref(adapter_id).unlink()
            fsync_dir(self.layout.refs)
            self._collector.live.ref_removed(adapter_id)
            self._collector.live.bump()
            self._listener.ref_removed(adapter_id)
            self._collector.collect_digests({digest})
            return digest

    @contextmanager
    def _telling(self) -> Iterator[None]:
        """The listener hears ``changing`` before this hold's changes and ``changed`` after them (under the store's lock)."""
        self._listener.changing()
        try:
            yield
        except BaseException:
            self._listener.changed(False)
            raise
        self._listener.changed(True)

    def _install_blob(self, root: str, source: Path, syncs: DeferredSyncs, *, synced: bool = True) -> None:
        """Rename verified bytes into ``blobs/``; ``syncs.flush`` syncs the directories changed (and the bytes, not ``synced``)."""
        dest = self.layout.blob(root)
        if dest.is_file():
            return  # same bytes already committed (another adapter shares this file)
        if not dest.parent.is_dir():
            dest.parent.mkdir()
            syncs.changed(dest.parent.parent)
        os.chmod(source, 0o444)  # a hard link in a view must not let a loader change the blob
        os.rename(source, dest)
        if synced:
            syncs.changed(dest.parent)
        else:
            syncs.placed(dest)  # synced in the batch's file round, before its manifest or ref is placed
        self._listener.blob_committed(root)  # verified as it was received or copied

    def _set_ref(self, adapter_id: str, complete: Manifest) -> None:
        """Point an id at a digest whose bytes are all here (``complete``, checked under the lock held); the previous
        digest's bytes go if nothing refers to them."""
        digest = complete.digest
        previous = self.catalog.read_ref(adapter_id)
        if previous != digest:
            self.temps.write_atomic(self.layout.ref(adapter_id), digest.encode("ascii"))
            self._collector.live.ref_set(adapter_id, digest, [f.root for f in complete.files])
            self._collector.live.bump()
            if previous is not None:
                self._collector.collect_digests({previous})
        self._listener.ref_set(adapter_id, digest)
