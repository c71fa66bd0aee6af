"""The on-disk, content-addressed adapter store.

Layout under ``root`` (after Uber Kraken: uploads and downloads in progress
live apart from the content-addressed cache, and partial data never shares a
directory with committed data)::

    format                        "2": the store format (digest scheme 2); absent in a new root until created
    lock                          flock'ed around every metadata change
    blobs/blake3/<2 hex>/<root>   committed files, named by their root (fabric.store.digests), read-only
    manifests/<digest>.json       one manifest per adapter digest (Manifest.to_json)
    refs/<id>                     adapter id -> digest; "/" in an id is written "%2F"
    partial/<digest>/             a peer download: data (sparse), manifest.json, lock
    uploads/<key>/                a client upload: data, meta.json, lock; key = sha256(id, whole-file BLAKE3)
    views/<digest>/               materialized PEFT directories: hard links into blobs
    signatures/<digest>           the author's Ed25519 signature of a digest, when it was signed (fabric.trust)
    quarantine/<root>-<ns>        blobs that failed a re-verification (fabric.store.integrity), kept as evidence
    tmp/                          temp files, each flock'ed by its writer until renamed

Commit order is blobs, then manifest, then ref, each written to a temp file,
fsync'ed, renamed and its directory fsync'ed, all under the lock: a reader
that sees a ref sees its manifest and its blobs. A crash leaves at most
orphans (blobs or manifests no ref reaches) and temp files, which the next
``AdapterStore`` on the root removes; partials and uploads are kept to resume.

Concurrency: threads and processes may share a root. Metadata changes hold
``flock(lock)`` (a fresh open file per acquisition, so threads exclude each
other too). A partial or upload is held by one open object at a time
(``flock`` on its own lock file); inside one store object, opening it again
returns the same object.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fabric.errors import AdapterNotFound, FabricError, IntegrityError, InvalidAdapter, InvalidArgument
from fabric.format.safetensors_index import MAX_HEADER_BYTES
from fabric.store.export import ExportDir
from fabric.store.files import COPY_BLOCK, decode_id, encode_id, fsync_dir, pwrite_all
from fabric.store.ids import validate_adapter_id, validate_digest
from fabric.store.integrity import StoreIntegrity, _is_digest
from fabric.store.manifest import CONFIG_FILE, DEFAULT_CHUNK_SIZE, WEIGHTS_FILE, FileHasher, Manifest, build_manifest, iter_file
from fabric.store.partial import PartialDownload, StorePartials
from fabric.store.quota import StoreQuota
from fabric.store.recovery import StoreRecovery
from fabric.store.signatures import StoreSignatures
from fabric.store.upload import StoreUploads, Upload


class AdapterStore(StoreQuota, StoreRecovery, StoreIntegrity, StoreSignatures, StorePartials, StoreUploads):
    """Adapters staged by id, stored by content, committed atomically, safe across restarts."""

    def __init__(
        self,
        root: Path | str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_bytes: int | None = None,
        max_adapter_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        export_dir: Path | str | None = None,
    ) -> None:
        """``export_dir``: keep every staged adapter there as a PEFT directory of hard links (``fabric.store.export``)."""
        self.root = Path(root)
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        #: largest adapter (config + weights) accepted from a client or a peer; None = no limit
        self.max_adapter_bytes = max_adapter_bytes
        #: largest safetensors header parsed or accepted
        self.max_header_bytes = max_header_bytes
        self._check_format()
        self.blobs = self.root / "blobs" / "blake3"
        self.manifests = self.root / "manifests"
        self.refs = self.root / "refs"
        self.partials = self.root / "partial"
        self.uploads = self.root / "uploads"
        self.views = self.root / "views"
        self.tmp = self.root / "tmp"
        self.signatures = self.root / "signatures"
        self._lock_path = self.root / "lock"
        self._cache: dict[str, Manifest] = {}
        self._open_lock = threading.Lock()
        self._open_partials: dict[str, PartialDownload] = {}
        self._open_uploads: dict[str, Upload] = {}
        for directory in (self.blobs, self.manifests, self.refs, self.partials, self.uploads, self.views, self.tmp, self.signatures):
            directory.mkdir(parents=True, exist_ok=True)
        self._init_integrity()
        self.exports: ExportDir | None = None
        with self._locked():
            self._recover()
            if export_dir is not None:
                self.exports = ExportDir(export_dir, self._blob, self._lock_path)
                # Only whole adapters: a blob quarantined before the restart has nothing to link to.
                self.exports.sync(m for m in self.list() if self._complete(m.digest) is not None)

    # ------------------------------------------------------------ locking and temp files

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def _new_temp(self) -> tuple[int, Path]:
        """A new empty temp file in tmp/, locked by the returned fd until it is closed."""
        while True:
            path = self.tmp / f"{os.getpid()}-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                return fd, path
            os.close(fd)  # a cleaner took it between create and lock

    def _write_atomic(self, dest: Path, data: bytes) -> None:
        fd, path = self._new_temp()
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
            os.rename(path, dest)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        fsync_dir(dest.parent)

    def _temp_blob(self, data: bytes) -> Path:
        fd, path = self._new_temp()
        try:
            pwrite_all(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path

    # ------------------------------------------------------------ paths

    def _blob(self, root: str) -> Path:
        return self.blobs / root[:2] / root

    def _manifest_path(self, digest: str) -> Path:
        return self.manifests / f"{digest}.json"

    def _ref_path(self, adapter_id: str) -> Path:
        return self.refs / encode_id(adapter_id)

    # ------------------------------------------------------------ reading

    def _read_ref(self, adapter_id: str) -> str | None:
        try:
            # Damaged text is returned as it is (never raised here): ``damaged()`` reports it.
            return self._ref_path(adapter_id).read_bytes().decode("ascii", "replace").strip()
        except FileNotFoundError:
            if not self.refs.is_dir():  # not "not staged": the store itself went (checked only on a miss)
                raise self._missing_store() from None
            return None

    def _refs(self) -> dict[str, str]:
        found: dict[str, str] = {}
        try:
            entries = list(os.scandir(self.refs))
        except FileNotFoundError:
            raise self._missing_store() from None
        for entry in entries:
            adapter_id = decode_id(entry.name)
            try:
                validate_adapter_id(adapter_id)
            except InvalidArgument:
                continue  # not a ref this store wrote
            digest = self._read_ref(adapter_id)
            if digest is not None:
                found[adapter_id] = digest
        return found

    def _load_manifest(self, digest: str) -> Manifest | None:
        """The manifest of ``digest``; None if absent; ``IntegrityError``/``InvalidAdapter`` if its file is damaged."""
        if not _is_digest(digest):
            raise IntegrityError(f"{digest[:80]!r} is not a digest")
        path = self._manifest_path(digest)
        cached = self._cache.get(digest)
        if cached is not None and path.is_file():  # another process may have collected it
            return cached
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._cache.pop(digest, None)
            return None
        manifest = Manifest.from_json(data)
        if manifest.digest != digest:
            raise IntegrityError(f"{self._manifest_path(digest)} holds the manifest of digest {manifest.digest}")
        self._cache[digest] = manifest
        return manifest

    def get(self, adapter_id: str) -> Manifest:
        """The committed manifest of an id (``AdapterNotFound`` naming the id)."""
        validate_adapter_id(adapter_id)
        digest = self._read_ref(adapter_id)
        if digest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        try:
            manifest = self._load_manifest(digest)
        except FabricError:
            raise IntegrityError(f"adapter {adapter_id!r} is damaged in this store: {self._problem(digest)}; unstage it, or promote it from a peer") from None
        if manifest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        return manifest.with_id(adapter_id)

    def _complete(self, digest: str) -> Manifest | None:
        """The manifest of ``digest`` when it and every blob it names are here; None when any is absent or damaged."""
        try:
            manifest = self._load_manifest(digest)
        except FabricError:
            return None
        if manifest is None or any(not self._blob(f.root).is_file() for f in manifest.files):
            return None
        return manifest

    def by_digest(self, digest: str) -> Manifest | None:
        """The committed manifest of a digest, under one of the ids referring to it; None if absent."""
        validate_digest(digest)
        manifest = self._complete(digest)
        if manifest is None:
            return None
        if self._read_ref(manifest.adapter_id) == digest:
            return manifest
        ids = sorted(i for i, d in self._refs().items() if d == digest)
        return manifest.with_id(ids[0]) if ids else None

    def list(self) -> list[Manifest]:
        """Every committed adapter whose manifest reads, sorted by id (partials and uploads are never listed).

        A damaged entry is left out here, never failing the whole list: ``damaged()`` names it.
        """
        found = []
        for adapter_id, digest in sorted(self._refs().items()):
            try:
                manifest = self._load_manifest(digest)
            except FabricError:
                continue
            if manifest is not None:  # else unstaged while we listed
                found.append(manifest.with_id(adapter_id))
        return found

    def blob_path(self, root: str) -> Path:
        """The path of a committed file by its root (for Fetch serving and loading)."""
        validate_digest(root, "file root")
        path = self._blob(root)
        if not path.is_file():
            raise AdapterNotFound(f"no committed file with root {root} in this store")
        return path

    def verify(self, adapter_id: str) -> Manifest:
        """Re-read an adapter's committed files, every chunk against its manifest; ``IntegrityError`` (and quarantine) on any difference."""
        manifest = self.get(adapter_id)
        for entry in manifest.files:
            self.verified_blob(manifest, entry, force=True)
        return manifest

    def materialize(self, adapter_id: str) -> Path:
        """A directory with adapter_config.json and adapter_model.safetensors (hard links into blobs) PEFT can load."""
        manifest = self.get(adapter_id)
        view = self.views / manifest.digest
        with self._locked():
            if self._read_ref(adapter_id) != manifest.digest:
                raise AdapterNotFound(f"adapter {adapter_id!r} was unstaged or restaged while being materialized")
            if (view / CONFIG_FILE).is_file() and (view / WEIGHTS_FILE).is_file():
                return view
            shutil.rmtree(view, ignore_errors=True)
            building = self.tmp / f"view-{secrets.token_hex(8)}"
            building.mkdir()
            for entry in manifest.files:
                os.link(self.verified_blob(manifest, entry), building / entry.name)
            os.rename(building, view)
            fsync_dir(self.views)
        return view

    # ------------------------------------------------------------ staging from a directory

    def stage(self, directory: Path | str, adapter_id: str) -> Manifest:
        """Copy a PEFT adapter directory in under ``adapter_id``; everything is checked before a byte is written."""
        validate_adapter_id(adapter_id)
        source = Path(directory)
        config_path, weights_path = source / CONFIG_FILE, source / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise InvalidAdapter(f"{path} does not exist: a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
        self._check_adapter_size(config_path.stat().st_size + weights_path.stat().st_size, f"staging {adapter_id!r}")
        manifest = build_manifest(adapter_id, config_path.read_bytes(), weights_path, self.chunk_size, max_header_bytes=self.max_header_bytes)
        if self._complete(manifest.digest) is not None:
            with self._locked():
                if self._complete(manifest.digest) is not None:
                    self._set_ref(adapter_id, manifest.digest)
                    return manifest
        self._check_quota(self._missing_bytes(manifest), f"staging {adapter_id!r}")
        sources = {manifest.files[0].root: self._temp_blob(manifest.config_json)}
        try:
            sources[manifest.weights.root] = self._copy_weights(weights_path, manifest)
            self._commit(manifest, adapter_id, sources, check_quota=True)
        finally:
            for path in sources.values():
                path.unlink(missing_ok=True)
        return manifest

    def _copy_weights(self, source: Path, manifest: Manifest) -> Path:
        """Copy into a temp file, hashing what was copied: the source may change after it was checked."""
        fd, path = self._new_temp()
        try:
            hasher = FileHasher(manifest.weights.chunk_size)
            with open(source, "rb") as handle:
                for block in iter_file(handle, COPY_BLOCK):
                    hasher.update(block)
                    pwrite_all(fd, block, hasher.size - len(block))
            if hasher.entry(WEIGHTS_FILE) != manifest.weights:
                raise IntegrityError(f"{source} changed while being staged (its chunk digests or size differ from the checked file)")
            os.fsync(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path

    # ------------------------------------------------------------ commit, refs, garbage

    def _commit(
        self, manifest: Manifest, adapter_id: str, sources: dict[str, Path], check_quota: bool = False, manifest_json: bytes | None = None
    ) -> bool:
        """Install blobs (renaming ``sources``: root -> temp file), manifest, then ref. True if the digest was already here.

        ``manifest_json``: ``manifest.to_json()`` when the caller has it already (~5 ms for Llama-3-8B shapes).

        Partials and uploads reserved their bytes when opened, so only staging
        re-checks the quota here (another writer may have taken the room).
        """
        with self._locked():
            # A manifest whose blobs were quarantined (or whose file is damaged) is not "existed": this commit repairs it.
            existed = self._complete(manifest.digest) is not None
            if not existed:
                if check_quota:
                    self._check_quota(self._missing_bytes(manifest), f"staging {adapter_id!r}")
                for entry in manifest.files:
                    self._install_blob(entry.root, sources[entry.root])
                self._write_atomic(self._manifest_path(manifest.digest), manifest_json or manifest.to_json())
                self._cache[manifest.digest] = manifest
            self._set_ref(adapter_id, manifest.digest)
        return existed

    def _install_blob(self, root: str, source: Path) -> None:
        dest = self._blob(root)
        if dest.is_file():
            return  # same bytes already committed (another adapter shares this file)
        if not dest.parent.is_dir():
            dest.parent.mkdir()
            fsync_dir(dest.parent.parent)
        os.chmod(source, 0o444)  # a hard link in a view must not let a loader change the blob
        os.rename(source, dest)
        fsync_dir(dest.parent)
        self._remember_verified(root)  # verified as it was received or copied
        self._release_quarantine(root)

    def _set_ref(self, adapter_id: str, digest: str) -> None:
        """Point an id at a digest (under the lock); the previous digest's bytes go if nothing refers to them."""
        previous = self._read_ref(adapter_id)
        if previous != digest:
            self._write_atomic(self._ref_path(adapter_id), digest.encode("ascii"))
            if previous is not None:
                self._collect()
        if self.exports is not None:  # every commit path (stage, upload, pull) ends here
            manifest = self._load_manifest(digest)
            if manifest is not None:
                self.exports.export(adapter_id, manifest)
            self._restore_exports()  # a commit may have brought a quarantined blob back

    def unstage(self, adapter_id: str) -> bool:
        """Remove an id; True when its bytes were removed too (no other id refers to its digest)."""
        validate_adapter_id(adapter_id)
        with self._locked():
            digest = self._read_ref(adapter_id)
            if digest is None:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
            self._ref_path(adapter_id).unlink()
            fsync_dir(self.refs)
            if self.exports is not None:
                self.exports.remove(adapter_id)
            self._collect()
            return not self._manifest_path(digest).exists()

