"""Client uploads: one safetensors file appended in order, resumable, committed atomically.

An upload is keyed by its id and the plain BLAKE3 of the whole file the
client declares (``StageBegin.safetensors_blake3``: chunk-size independent, so
a client can compute it before it asks the node's chunk size). The client
also declares the weights file's root at this store's chunk size
(``weights_root``), which names the blob before any byte arrives (quota,
signatures). Bytes are chunk-hashed as they are appended, once; commit checks
the root the client declared against the one the bytes give (hashing the file
on disk again when another writer changed it since our last append).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.errors import Busy, IntegrityError, InvalidAdapter, InvalidArgument, InvalidHeader
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.safetensors_index import header_length, read_index
from adapter_fabric.store.committer import Commit, Committer
from adapter_fabric.store.files import COPY_BLOCK, lock_held_dir, pread_exact, pwrite_all, write_stamp
from adapter_fabric.store.ids import validate_adapter_id, validate_digest
from adapter_fabric.store.lock_watch import WatchedLock
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, FileHasher, Manifest, hash_bytes, manifest_of
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.tenants import TenantQuotas, TenantReservation


class Uploads:
    """The client uploads of one store: opened by (id, whole-file BLAKE3), one stream each at a time."""

    def __init__(self, committer: Committer, quota: Quota, tenants: TenantQuotas, chunk_size: int) -> None:
        self.committer = committer
        self.quota = quota
        self.tenants = tenants
        self._tenant_holds: dict[str, TenantReservation] = {}  # guarded by _lock: what each open upload reserved of its tenant's quota
        #: the chunk size new uploads are hashed at (the store's)
        self.chunk_size = chunk_size
        self._lock = WatchedLock("uploads registry")  # guards _open
        self._open: dict[str, Upload] = {}
        self._opening: set[str] = set()  # keys of uploads being opened (outside the lock): a second stream is Busy

    def _upload_dir(self, adapter_id: str, blake3: str) -> Path:
        key = hashlib.sha256(f"{adapter_id}\0{blake3}".encode()).hexdigest()
        return self.committer.layout.uploads / key

    def offset(self, adapter_id: str, blake3: str) -> int:
        """Bytes of an interrupted upload of (id, whole-file BLAKE3) kept here; 0 when none."""
        validate_adapter_id(adapter_id)
        validate_digest(blake3, f"{WEIGHTS_FILE} BLAKE3")
        with self._lock:
            current = self._open.get(self._upload_dir(adapter_id, blake3).name)
            if current is not None:
                return current.offset
        return self._kept_offset(self._upload_dir(adapter_id, blake3), adapter_id, blake3)

    def _kept_offset(self, directory: Path, adapter_id: str, blake3: str) -> int:
        """Bytes an interrupted upload left in ``directory`` that a resume keeps; 0 when none, or when it is damaged."""
        try:
            meta = json.loads((directory / "meta.json").read_bytes())
            if meta.get("adapter_id") != adapter_id or meta.get("blake3") != blake3 or os.stat(directory / "data").st_size > meta.get("size", -1):
                return 0  # damaged or not this upload's: it restarts from 0 (Upload truncates it)
            return os.stat(directory / "data").st_size
        except (OSError, ValueError, AttributeError, TypeError):
            return 0

    def open(self, adapter_id: str, config_json: bytes, size: int, blake3: str, weights_root: str) -> Upload:
        """A client upload of a safetensors file; reopening the same (id, whole-file BLAKE3) continues at ``offset``.

        ``weights_root``: the root the client computed at this store's chunk size; checked at commit.
        """
        validate_adapter_id(adapter_id)
        validate_digest(blake3, f"{WEIGHTS_FILE} BLAKE3")
        validate_digest(weights_root, f"{WEIGHTS_FILE} root")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"upload of {adapter_id!r}: size {size!r} must be a non-negative integer")
        self.quota.check_adapter_size(size + len(config_json), f"uploading {adapter_id!r}")
        PeftAdapterConfig.from_json_bytes(config_json)  # refuse a bad config before any byte moves
        directory = self._upload_dir(adapter_id, blake3)
        key = directory.name
        with self._lock:
            if key in self._open or key in self._opening:
                # Each stream owns its upload: a second writer never shares (and never closes) the first's.
                raise Busy(
                    f"an upload of {adapter_id!r} with these bytes (BLAKE3 {blake3}) is being sent by another Stage stream; "
                    f"retry when it ends"
                )
            # Space is reserved now, for what is not committed already: two uploads opened together cannot pass the limit.
            config_root = hash_bytes(CONFIG_FILE, config_json, self.chunk_size).root
            blob = self.committer.layout.blob
            reserved = (0 if blob(weights_root).is_file() else size) + (0 if blob(config_root).is_file() else len(config_json))
            # The tenant's quota before the store's (which may evict): held, like the store's, until the upload ends.
            tenant = self.tenants.reserve(adapter_id, {config_root: len(config_json), weights_root: size}, f"uploading {adapter_id!r}", writes=key)
            try:
                # What a resumed upload holds on disk is counted already.
                self.quota.check_room(max(0, reserved - self._kept_offset(directory, adapter_id, blake3)), f"uploading {adapter_id!r}")
                lock_fd = lock_held_dir(directory, f"upload of {adapter_id!r} (BLAKE3 {blake3})")
            except BaseException as exc:
                tenant.release()
                if isinstance(exc, OSError):  # a full disk: an empty directory made just now stays out of the listing
                    _remove_if_empty(directory)
                raise
            self._opening.add(key)
            self._tenant_holds[key] = tenant
            self.quota.hold_pending(key, lambda: reserved)  # in full while it opens
        # Opened (its files synced) outside the lock, so concurrent Stage calls open their uploads together.
        try:
            upload = Upload(self, directory, lock_fd, adapter_id, bytes(config_json), size, blake3, weights_root, reserved)
        except BaseException:
            if not _holds_bytes(directory):  # nothing to resume (a full disk refused its first write): nothing left listed
                shutil.rmtree(directory, ignore_errors=True)
            os.close(lock_fd)
            with self._lock:
                self._opening.discard(key)
            self.release(key)
            raise
        with self._lock:
            self._opening.discard(key)
            self._open[key] = upload
            # Its reservation counts in full: what it has not written yet is on its way.
            self.quota.hold_pending(key, lambda: upload.reserved - upload.offset)
        return upload

    def release(self, key: str) -> None:
        """The upload under ``key`` let go (committed, closed or discarded): forget it and its reservation."""
        with self._lock:
            self._open.pop(key, None)
            tenant = self._tenant_holds.pop(key, None)
        self.quota.release_pending(key)
        if tenant is not None:
            tenant.release()


class Upload:
    """A client's upload of a safetensors file, appended in order; nothing is committed until ``commit``."""

    def __init__(
        self, uploads: Uploads, directory: Path, lock_fd: int, adapter_id: str, config_json: bytes, size: int, blake3: str, weights_root: str,
        reserved: int,
    ) -> None:
        self._committer = uploads.committer
        self._max_header_bytes = uploads.quota.max_header_bytes
        self._chunk_size = uploads.chunk_size
        self._release: Callable[[str], None] = uploads.release
        self.adapter_id = adapter_id
        self.config_json = config_json
        self.size = size
        self.blake3 = blake3
        self.weights_root = weights_root
        #: after commit: True when the same content was already committed
        self.already_staged = False
        #: bytes of store quota this upload holds until it ends (its unwritten part counts as used)
        self.reserved = reserved
        self._directory = directory
        self._lock_fd: int | None = lock_fd
        self._lock = WatchedLock("upload")
        meta = json.dumps({"adapter_id": adapter_id, "blake3": blake3, "size": size}, sort_keys=True).encode()
        meta_path = directory / "meta.json"
        fresh = not meta_path.is_file() or meta_path.read_bytes() != meta
        self._fd: int | None = os.open(directory / "data", os.O_RDWR | os.O_CREAT, 0o644)
        if fresh or os.fstat(self._open_fd).st_size > size:
            if os.fstat(self._open_fd).st_size:  # a new data file is empty already: nothing to truncate or sync
                os.ftruncate(self._open_fd, 0)
                os.fsync(self._open_fd)
            # Not synced: after a power cut a resume finds no meta and restarts from 0 (the Stage had not returned);
            # each appended byte is synced, and commit verifies every byte against the declared root anyway.
            self._committer.temps.replace(meta_path, meta)
        self._offset = os.fstat(self._open_fd).st_size
        self._hasher = self._hash_kept(self._offset)
        self._written_stamp = write_stamp(self._open_fd)  # after our last write: another writer since is caught at commit

    @property
    def _open_fd(self) -> int:
        """The data file's descriptor; only called while the writer is open (``close`` sets it to None)."""
        assert self._fd is not None
        return self._fd

    @property
    def _open_lock_fd(self) -> int:
        assert self._lock_fd is not None
        return self._lock_fd

    def _hash_kept(self, end: int) -> FileHasher:
        """A chunk hasher fed the bytes [0, end) kept on disk (a resume), so every byte is hashed once in all."""
        hasher = FileHasher(self._chunk_size)
        for offset in range(0, end, COPY_BLOCK):
            hasher.update(pread_exact(self._open_fd, min(COPY_BLOCK, end - offset), offset, f"upload of {self.adapter_id!r}"))
        return hasher

    @property
    def offset(self) -> int:
        """Bytes received and written durably: the next append starts here."""
        return self._offset

    def append(self, offset: int, data: bytes) -> None:
        with self._lock:
            self._require_open()
            if offset != self._offset:
                raise InvalidArgument(f"upload of {self.adapter_id!r}: data at offset {offset}, expected offset {self._offset}")
            if offset + len(data) > self.size:
                raise InvalidArgument(
                    f"upload of {self.adapter_id!r}: {len(data)} bytes at offset {offset} end at {offset + len(data)}, "
                    f"beyond the declared size {self.size}"
                )
            if offset == 0 and len(data) >= 8:  # refuse an oversized header before storing a byte of it
                try:
                    header_length(bytes(data[:8]), max_header_bytes=self._max_header_bytes)
                except InvalidHeader as exc:
                    self._close_locked(remove=True)  # nothing to resume: the same bytes would be refused again
                    raise InvalidHeader(f"the weights of {self.adapter_id!r}: {exc}") from None
            pwrite_all(self._open_fd, data, offset)
            if offset + len(data) < self.size:
                # The bytes a resume keeps are synced as they come; the last piece's are synced by the commit's batch with
                # every other commit of it (a power cut before that commit restarts the upload: commit verifies every byte).
                os.fdatasync(self._open_fd)
            self._written_stamp = write_stamp(self._open_fd)
            self._hasher.update(data)
            self._offset += len(data)

    def rewind(self, offset: int) -> None:
        """Resume from ``offset`` below what is held: a client that read the offset while its previous stream was
        still landing bytes sends them again (the same bytes, by the upload's BLAKE3), so the rest is dropped."""
        with self._lock:
            self._require_open()
            if not 0 <= offset <= self._offset:
                raise InvalidArgument(
                    f"Stage of {self.adapter_id!r} resumes at offset {offset} but this node holds {self._offset} bytes; "
                    f"ask UploadOffset and resume from there"
                )
            os.ftruncate(self._open_fd, offset)
            os.fsync(self._open_fd)
            self._offset = offset
            self._hasher = self._hash_kept(offset)
            self._written_stamp = write_stamp(self._open_fd)

    def commit(self) -> Manifest:
        """Check size, root, config, header and tensors, then commit; any failure commits nothing and drops the upload."""
        outcome = commit_uploads([self])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def seal(self) -> tuple[Manifest, dict[str, Path], Path]:
        """Check size, root, config, header and tensors: the manifest, its sources (root -> file) and the config's temp blob
        (the caller removes it). A refused upload (``InvalidAdapter``, ``IntegrityError``) is dropped: its bytes cannot commit."""
        with self._lock:
            self._require_open()
            if self._offset != self.size:
                raise InvalidArgument(f"upload of {self.adapter_id!r} holds {self._offset} of {self.size} bytes: send the rest first")
            data_path = self._directory / "data"
            try:
                if write_stamp(self._open_fd) != self._written_stamp:  # written by someone else since: hash what is on disk
                    self._hasher = self._hash_kept(self.size)
                weights = self._hasher.entry(WEIGHTS_FILE)
                if weights.root != self.weights_root:
                    raise IntegrityError(
                        f"upload of {self.adapter_id!r}: received {self.size} bytes with root {weights.root}, "
                        f"declared {self.weights_root} (the file changed while it was sent, or the client hashed it at another chunk size)"
                    )
                index = read_index(data_path, max_header_bytes=self._max_header_bytes, name=f"the weights of {self.adapter_id!r}")
                manifest = manifest_of(self.adapter_id, self.config_json, weights, index)
                # Neither file is synced yet: the commit's batch syncs them in one round with the other commits' files.
                config_blob = self._committer.temps.blob(self.config_json, sync=False)
            except (InvalidAdapter, IntegrityError):
                self._close_locked(remove=True)
                raise
            return manifest, {manifest.files[0].root: config_blob, manifest.weights.root: data_path}, config_blob

    def settle(self, outcome: bool | BaseException) -> None:
        """After its commit: ``outcome`` is whether the digest was here already (the upload is done and goes), or the
        commit's error (a refusal of the bytes drops them; anything else leaves the upload to its owner's close)."""
        with self._lock:
            if not isinstance(outcome, BaseException):
                self.already_staged = outcome
                self._close_locked(remove=True)
            elif isinstance(outcome, (InvalidAdapter, IntegrityError)) and self._fd is not None:
                self._close_locked(remove=True)

    def discard(self) -> None:
        with self._lock:
            if self._fd is not None:
                self._close_locked(remove=True)

    def close(self) -> None:
        """Let go of the upload, keeping its bytes for a later resume (one that holds none leaves nothing behind)."""
        with self._lock:
            if self._fd is not None:
                self._close_locked(remove=self._offset == 0)

    def _require_open(self) -> None:
        if self._fd is None:
            raise InvalidArgument(f"upload of {self.adapter_id!r} was committed, closed or discarded")

    def _close_locked(self, remove: bool) -> None:
        if remove:
            shutil.rmtree(self._directory, ignore_errors=True)
        os.close(self._open_fd)
        os.close(self._open_lock_fd)
        self._fd = self._lock_fd = None
        self._release(self._directory.name)


def _holds_bytes(directory: Path) -> bool:
    """Whether an upload directory holds received bytes (a resume's worth keeping)."""
    try:
        return os.stat(directory / "data").st_size > 0
    except FileNotFoundError:
        return False


def _remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` if it holds nothing (made just now by a refused open); a directory another writer uses stays."""
    try:
        os.rmdir(directory)
    except OSError:
        pass


def commit_uploads(uploads: list[Upload]) -> list[Manifest | BaseException]:
    """Seal each upload and commit the sealed ones as one group (``Committer.commit_all``: one journal flush, one sync per
    directory); each outcome in order: its manifest (durable), or its own error. One refusal never fails the others."""
    outcomes: list[Manifest | BaseException] = []
    sealed: list[tuple[int, Upload, Manifest, dict[str, Path], Path]] = []
    for upload in uploads:
        try:
            manifest, sources, config_blob = upload.seal()
        except Exception as exc:  # this upload's refusal: the others go on
            outcomes.append(exc)
            continue
        sealed.append((len(outcomes), upload, manifest, sources, config_blob))
        outcomes.append(manifest)
    if not sealed:
        return outcomes
    committer = sealed[0][1]._committer
    try:
        results = committer.commit_all([Commit(m, u.adapter_id, sources, frozenset(sources)) for _, u, m, sources, _ in sealed])
    finally:
        for *_, config_blob in sealed:
            config_blob.unlink(missing_ok=True)
    for (n, upload, _, _, _), result in zip(sealed, results, strict=True):
        upload.settle(result)
        if isinstance(result, BaseException):
            outcomes[n] = result
    return outcomes
