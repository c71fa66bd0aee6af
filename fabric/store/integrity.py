"""Bytes at rest: re-verified before they are loaded or served, quarantined when corrupt, damage reported per adapter.

A committed blob is trusted only while it is known unchanged since it was
last verified. That knowledge is a per-blob stamp (inode, size, mtime, ctime)
taken when the bytes were verified (at commit, or by a full re-read here): a
write, truncation, chmod, link or replacement of the file changes the stamp,
and the next load or serve re-verifies every chunk (``FileEntry.verify_chunk``,
whatever the digest scheme) before a byte is used. ctime cannot be set back
from user space. Not caught by the stamp: the device corrupting bytes below
the page cache; the scrub (``scrub``) re-reads every blob regardless of
stamps, at a bounded rate.

A blob that fails is moved out of ``blobs/`` into ``quarantine/`` (never
deleted: it is evidence), so no later read can serve it; its adapters are
then reported by ``damaged()`` until the bytes are committed again (a pull
from a peer repairs them: the committer tells ``blob_committed``). Export
directory entries linking to it are withdrawn with it (they share its inode)
and exported again with the repair.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapter_fabric.errors import AdapterNotFound, FabricError, IntegrityError
from adapter_fabric.store.catalog import Catalog, is_digest
from adapter_fabric.store.durable import fsync_dir
from adapter_fabric.store.export import ExportDir
from adapter_fabric.store.files import COPY_BLOCK, check_header, pread_exact
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import FILE_NAMES, FileEntry, Manifest
from adapter_fabric.store.scrub_pace import ScrubPace
from adapter_fabric.store.stamps import FileStamp, file_stamp
from adapter_fabric.store.store_lock import StoreLock

#: told ``(adapter_id, digest, error)`` when an adapter's bytes at rest are found damaged (quarantined, or missing)
DamageListener = Callable[[str, str, IntegrityError], None]


@dataclass(frozen=True)
class DamagedEntry:
    """An adapter id this store cannot load or serve as it is, and why."""

    adapter_id: str
    digest: str  # what its id entry holds ("" when that is unreadable)
    problem: str


class Integrity:
    """Verified reads of committed blobs, quarantine, damage reports, the scrub."""

    def __init__(
        self, layout: StoreLayout, catalog: Catalog, lock: StoreLock, exports: ExportDir | None, on_damage: DamageListener | None = None
    ) -> None:
        """``on_damage``: told of damage a verified read finds (a node queues a pull of the adapter again: node.repair)."""
        self.layout = layout
        self.catalog = catalog
        self.lock = lock
        self.exports = exports
        self._verified_at: dict[str, FileStamp] = {}  # blob root -> stamp when its bytes last verified
        self._sha256_of: dict[str, str] = {}  # blob root -> its sha256 (file_sha256)
        self._withdrawn: set[str] = set()  # ids whose export entries went with a quarantined blob, until it is committed again
        self.on_damage = on_damage  # the scrub tells its own

    # ------------------------------------------------------------ verified reads

    def blob_committed(self, root: str) -> None:
        """The committer renamed verified bytes of ``root`` into ``blobs/`` (under the lock): remember its stamp, drop old evidence."""
        try:
            self._verified_at[root] = file_stamp(self.layout.blob(root))
        except FileNotFoundError:
            self._verified_at.pop(root, None)
        for entry in os.scandir(self.layout.quarantine):
            if entry.name.startswith(root + "-"):
                os.unlink(entry.path)

    def verified_blob(self, manifest: Manifest, entry: FileEntry, *, force: bool = False) -> Path:
        """The path of ``entry``'s committed blob, its bytes verified since they were last written.

        Cheap when the blob's stamp is the one it had when last verified; else
        (or with ``force``) every chunk is read and checked. A blob that fails
        is quarantined and ``IntegrityError`` names the adapter.
        """
        path = self.layout.blob(entry.root)
        what = f"adapter {manifest.adapter_id!r} ({manifest.digest[:12]})"
        try:
            before = file_stamp(path)
        except FileNotFoundError:
            raise self._missing(manifest, entry, what) from None
        if not force and self._verified_at.get(entry.root) == before:
            return path
        try:
            self._verify_file(path, entry, manifest)
        except FileNotFoundError:
            raise self._missing(manifest, entry, what) from None
        except IntegrityError as exc:
            self.quarantine(entry.root, before)
            raise self._damage(manifest, IntegrityError(f"{what}: {exc}; the blob was quarantined (promote the adapter from a peer or re-stage it)")) from None
        if file_stamp(path) == before:  # nobody wrote it while we read it
            self._verified_at[entry.root] = before
        return path

    def _missing(self, manifest: Manifest, entry: FileEntry, what: str) -> FabricError:
        """A blob not there: the id was unstaged or evicted meanwhile (``AdapterNotFound``: nothing is damaged), or, while the id
        still names the digest, damage (``IntegrityError``: quarantined, or removed by hand)."""
        if self.catalog.read_ref(manifest.adapter_id) != manifest.digest:
            return AdapterNotFound(f"{what} was unstaged or evicted meanwhile: its bytes left this store; pull it again")
        return self._damage(manifest, IntegrityError(f"{what}: its {entry.name} (blob {entry.root}) is missing or quarantined; promote it from a peer or re-stage it"))

    def _damage(self, manifest: Manifest, error: IntegrityError) -> IntegrityError:
        """Tell ``on_damage`` of ``error`` (unless the id was unstaged meanwhile: nothing to repair); ``error`` to raise."""
        if self.on_damage is not None and self.catalog.read_ref(manifest.adapter_id) == manifest.digest:
            self.on_damage(manifest.adapter_id, manifest.digest, error)
        return error

    def verified_weights(self, manifest: Manifest) -> Path:
        """``verified_blob`` of the weights file (what a promote maps and a Fetch serves)."""
        return self.verified_blob(manifest, manifest.weights)

    def _verify_file(self, path: Path, entry: FileEntry, manifest: Manifest, pace: Callable[[int], None] | None = None) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != entry.size:
                raise IntegrityError(f"{entry.name} is {os.fstat(fd).st_size} bytes on disk, its manifest says {entry.size}")
            for index in range(entry.chunk_count):
                offset, length = entry.chunk_span(index)
                entry.verify_chunk(index, pread_exact(fd, length, offset, entry.name))  # refusals name the file, never the node's path
                if pace is not None:
                    pace(length)
        finally:
            os.close(fd)
        if entry.name == manifest.weights.name:
            check_header(manifest, path)

    def quarantine(self, root: str, seen: FileStamp) -> None:
        """Move a corrupt blob out of ``blobs/`` (unless it was replaced since ``seen``); it stays as evidence."""
        self._verified_at.pop(root, None)
        with self.lock.held():
            path = self.layout.blob(root)
            try:
                if file_stamp(path) != seen:
                    return  # rewritten since we read it: the next read verifies it again
            except FileNotFoundError:
                return
            moved = self.layout.quarantine / f"{root}-{time.time_ns()}"
            os.replace(path, moved)
            fsync_dir(path.parent)
            fsync_dir(self.layout.quarantine)
            evidence = os.stat(moved)
            self._drop_views_of(evidence)
            if self.exports is not None:  # its hard links there share the corrupt inode
                self._withdrawn.update(self.exports.withdraw(evidence))

    def _drop_views_of(self, evidence: os.stat_result) -> None:
        """Remove every materialized view (``views/<digest>/``) holding a hard link to a quarantined blob (under the lock).

        ``materialize`` builds a view again from verified blobs when it is next asked for one.
        """
        for view in os.scandir(self.layout.views):
            for name in FILE_NAMES:
                try:
                    st = os.stat(os.path.join(view.path, name))
                except FileNotFoundError:
                    continue
                if (st.st_ino, st.st_dev) == (evidence.st_ino, evidence.st_dev):
                    shutil.rmtree(view.path, ignore_errors=True)
                    break

    def restore_exports(self) -> None:
        """Export again the ids withdrawn with a quarantined blob once all their bytes are committed again (under the lock)."""
        for adapter_id in sorted(self._withdrawn):
            digest = self.catalog.read_ref(adapter_id)
            manifest = self.catalog.complete(digest) if digest is not None and is_digest(digest) else None
            if manifest is not None and self.exports is not None:
                self.exports.export(adapter_id, manifest)
            if digest is None or manifest is not None:  # unstaged, or back: nothing more to restore
                self._withdrawn.discard(adapter_id)

    def file_sha256(self, manifest: Manifest) -> dict[str, str]:
        """Each file's whole-file sha256 (hex, by file name), read from its verified blob; remembered per blob.

        Off every transfer's path (digest scheme 2 never needs it): for people comparing a file with the
        sha256 a model hub lists (``GetManifestRequest.with_sha256``, ``fabric inspect --sha256``).
        """
        found = {}
        for entry in manifest.files:
            if entry.root not in self._sha256_of:
                digest = hashlib.sha256()
                try:
                    with open(self.verified_blob(manifest, entry), "rb") as f:
                        while block := f.read(COPY_BLOCK):
                            digest.update(block)
                except FileNotFoundError:  # verified a moment ago: unstaged since
                    raise AdapterNotFound(f"adapter {manifest.adapter_id!r} left the store while its sha256 was read") from None
                self._sha256_of[entry.root] = digest.hexdigest()
            found[entry.name] = self._sha256_of[entry.root]
        return found

    # ------------------------------------------------------------ damage

    # ------------------------------------------------------------ scrub

    def scrub(self, rate: int = 0, stop: threading.Event | None = None, on_damage: DamageListener | None = None) -> int:
        """Re-read and verify every committed blob (stamps ignored); the count of damaged adapters.

        ``rate`` above 0: at most that many bytes/s, working at most a tenth of the time (``scrub_pace``); 0: unbounded.
        A corrupt blob is quarantined; ``on_damage(adapter_id, digest, error)`` is told (e.g. to re-pull it from a peer).
        """
        pace = ScrubPace(rate, time.monotonic, stop.wait if stop is not None else time.sleep) if rate > 0 else None
        bad = 0
        for manifest in self.catalog.each(keep=False):  # one at a time, not cached: the scrub holds one manifest, not 4,096
            for entry in manifest.files:
                if stop is not None and stop.is_set():
                    return bad
                try:
                    before = file_stamp(self.layout.blob(entry.root))
                    self._verify_file(self.layout.blob(entry.root), entry, manifest, pace)
                    if file_stamp(self.layout.blob(entry.root)) == before:
                        self._verified_at[entry.root] = before
                except FileNotFoundError:
                    continue  # unstaged while we scrubbed
                except IntegrityError as exc:
                    self.quarantine(entry.root, before)
                    bad += 1
                    if on_damage is not None:
                        on_damage(manifest.adapter_id, manifest.digest, exc)
                    break
        return bad
