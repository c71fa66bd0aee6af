"""The one path by which anything becomes committed: blobs, then manifest, then ref, under the store's lock.

Every writer (staging from a directory, a client upload, a peer download, a
repair) hands its verified temp files to ``Committer.commit``; nothing else
writes into ``blobs/``, ``manifests/`` or ``refs/``. Each step is written to a
temp file, fsync'ed, renamed and its directory fsync'ed, so a reader that sees
a ref sees its manifest and its blobs. A crash leaves at most orphans (blobs
or manifests no ref reaches) and temp files, which recovery removes.

What follows a commit elsewhere (integrity stamps, the export directory) is
told through the ``CommitListener`` handed in, so the committer knows neither.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.durable import StoreLock, TempFiles
from adapter_fabric.store.files import fsync_dir
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.recovery import GarbageCollector


class CommitListener(Protocol):
    """Told of each change the committer makes, under the store's lock."""

    def blob_committed(self, root: str) -> None:
        """The verified bytes of ``root`` were just renamed into ``blobs/``."""

    def ref_set(self, adapter_id: str, digest: str) -> None:
        """``adapter_id`` now refers to ``digest`` (its manifest and blobs are committed)."""

    def ref_removed(self, adapter_id: str) -> None:
        """``adapter_id`` was unstaged."""


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

    def commit(
        self, manifest: Manifest, adapter_id: str, sources: dict[str, Path], *, check_room: bool = False, manifest_json: bytes | None = None
    ) -> bool:
        """Install blobs (renaming ``sources``: root -> temp file), manifest, then ref. True if the digest was already here.

        ``manifest_json``: ``manifest.to_json()`` when the caller has it already (~5 ms for Llama-3-8B shapes).
        ``check_room``: re-check the store's limit under the lock; partials and uploads reserved their bytes
        when they opened, so only staging from a directory asks (another writer may have taken the room).
        """
        with self.lock.held():
            # A manifest whose blobs were quarantined (or whose file is damaged) is not "existed": this commit repairs it.
            existed = self.catalog.complete(manifest.digest) is not None
            if not existed:
                if check_room:
                    self.quota.check_room(self.catalog.missing_bytes(manifest), f"staging {adapter_id!r}", lock_held=True)
                for entry in manifest.files:
                    self._install_blob(entry.root, sources[entry.root])
                self.temps.write_atomic(self.layout.manifest(manifest.digest), manifest_json or manifest.to_json())
                self.catalog.remember(manifest)
            self._set_ref(adapter_id, manifest.digest)
        return existed

    def commit_ref(self, manifest: Manifest) -> bool:
        """Point ``manifest.adapter_id`` at its digest when every byte of it is committed already; False when it is not."""
        with self.lock.held():
            if self.catalog.complete(manifest.digest) is None:
                return False
            self._set_ref(manifest.adapter_id, manifest.digest)
            return True

    def require_ref(self, manifest: Manifest) -> None:
        """``commit_ref``, or ``AdapterNotFound`` when the digest's bytes went meanwhile."""
        if not self.commit_ref(manifest):
            raise AdapterNotFound(
                f"the bytes of {manifest.digest} were removed from this store before {manifest.adapter_id!r} referred to them; pull again"
            )

    def remove_ref(self, adapter_id: str) -> str | None:
        """Unstage ``adapter_id``; the digest it referred to (None when it was not staged). Unreferenced bytes go."""
        with self.lock.held():
            digest = self.catalog.read_ref(adapter_id)
            if digest is None:
                return None
            self.layout.ref(adapter_id).unlink()
            fsync_dir(self.layout.refs)
            self._listener.ref_removed(adapter_id)
            self._collector.collect()
            return digest

    def write_metadata(self, dest: Path, data: bytes) -> None:
        """Write a small metadata file (a signature) atomically, under the lock."""
        with self.lock.held():
            self.temps.write_atomic(dest, data)

    def _install_blob(self, root: str, source: Path) -> None:
        dest = self.layout.blob(root)
        if dest.is_file():
            return  # same bytes already committed (another adapter shares this file)
        if not dest.parent.is_dir():
            dest.parent.mkdir()
            fsync_dir(dest.parent.parent)
        os.chmod(source, 0o444)  # a hard link in a view must not let a loader change the blob
        os.rename(source, dest)
        fsync_dir(dest.parent)
        self._listener.blob_committed(root)  # verified as it was received or copied

    def _set_ref(self, adapter_id: str, digest: str) -> None:
        """Point an id at a digest (under the lock); the previous digest's bytes go if nothing refers to them."""
        previous = self.catalog.read_ref(adapter_id)
        if previous != digest:
            self.temps.write_atomic(self.layout.ref(adapter_id), digest.encode("ascii"))
            if previous is not None:
                self._collector.collect()
        self._listener.ref_set(adapter_id, digest)
