"""The on-disk, content-addressed adapter store.

Layout under ``root`` (after Uber Kraken: uploads and downloads in progress
live apart from the content-addressed cache, and partial data never shares a
directory with committed data)::

    lock                          flock'ed around every metadata change
    blobs/sha256/<2 hex>/<hex>    committed files, named by their own sha256, read-only
    manifests/<digest>.json       one manifest per adapter digest (Manifest.to_json)
    refs/<id>                     adapter id -> digest; "/" in an id is written "%2F"
    partial/<digest>/             a peer download: data (sparse), manifest.json, lock
    uploads/<key>/                a client upload: data, meta.json, lock; key = sha256(id, sha256)
    views/<digest>/               materialized PEFT directories: hard links into blobs
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

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fabric.config import PeftAdapterConfig
from fabric.errors import AdapterNotFound, FabricError, IntegrityError, InvalidAdapter, InvalidArgument, InvalidHeader, LimitExceeded, QuotaExceeded
from fabric.ids import validate_adapter_id, validate_digest
from fabric.manifest import (
    CONFIG_FILE,
    DEFAULT_CHUNK_SIZE,
    WEIGHTS_FILE,
    FileHasher,
    Manifest,
    build_manifest,
    iter_file,
)
from fabric.ordered_hash import DEFAULT_HOLD_BYTES, InOrderHasher
from fabric.safetensors_index import MAX_HEADER_BYTES, header_length, read_index

_COPY_BLOCK = 1 << 20
_WRITEBACK_RUN = 8 << 20  # start a partial's writeback in runs this long (one call per ~8 chunks)


# ---------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as exc:
        # A full disk is the store's limit too: say so as QuotaExceeded (RESOURCE_EXHAUSTED), not a bare OSError.
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuotaExceeded(
                f"the disk holding the adapter store is full ({os.strerror(exc.errno)}) writing {view.nbytes} bytes "
                f"at offset {offset}; nothing was committed: free space or unstage adapters, then retry"
            ) from None
        raise


def _load_sync_file_range():
    name = ctypes.util.find_library("c")
    try:
        func = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None  # not Linux/glibc: commit's fdatasync does all the work
    func.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    func.restype = ctypes.c_int
    return func


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range, do not wait for it


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range out now, so the fdatasync at commit finds little left (a hint: errors surface there)."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _pread_exact(fd: int, length: int, offset: int, what: str) -> bytes:
    parts, got = [], 0
    while got < length:
        block = os.pread(fd, length - got, offset + got)
        if not block:
            raise IntegrityError(f"{what}: file ends at offset {offset + got}, {length - got} bytes short")
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def _encode_id(adapter_id: str) -> str:
    # "%" is outside the id alphabet, so this is reversible and never nests directories.
    return adapter_id.replace("/", "%2F")


def _decode_id(name: str) -> str:
    return name.replace("%2F", "/")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_held_dir(directory: Path, what: str) -> int:
    """Create ``directory`` if needed and hold ``directory/lock``; the fd keeps the hold."""
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # removed by a cleaner between mkdir and open
            continue
        if not _try_lock(fd):
            os.close(fd)
            raise InvalidArgument(f"{what} is open in another process or store object; close it there or retry later")
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)  # a cleaner removed the directory while we waited: start again


def _remove_if_unheld(directory: Path) -> bool:
    """Remove a partial/upload directory unless a live owner holds its lock."""
    try:
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        return True
    try:
        if not _try_lock(fd):
            return False
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the store


class AdapterStore:
    """Adapters staged by id, stored by content, committed atomically, safe across restarts."""

    def __init__(
        self,
        root: Path | str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_bytes: int | None = None,
        max_adapter_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.root = Path(root)
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        #: largest adapter (config + weights) accepted from a client or a peer; None = no limit
        self.max_adapter_bytes = max_adapter_bytes
        #: largest safetensors header parsed or accepted
        self.max_header_bytes = max_header_bytes
        self.blobs = self.root / "blobs" / "sha256"
        self.manifests = self.root / "manifests"
        self.refs = self.root / "refs"
        self.partials = self.root / "partial"
        self.uploads = self.root / "uploads"
        self.views = self.root / "views"
        self.tmp = self.root / "tmp"
        self._lock_path = self.root / "lock"
        self._cache: dict[str, Manifest] = {}
        self._open_lock = threading.Lock()
        self._open_partials: dict[str, PartialDownload] = {}
        self._open_uploads: dict[str, Upload] = {}
        for directory in (self.blobs, self.manifests, self.refs, self.partials, self.uploads, self.views, self.tmp):
            directory.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self._recover()

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
            _pwrite_all(fd, data, 0)
            os.fsync(fd)
            os.rename(path, dest)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        _fsync_dir(dest.parent)

    def _temp_blob(self, data: bytes) -> Path:
        fd, path = self._new_temp()
        try:
            _pwrite_all(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path

    # ------------------------------------------------------------ paths

    def _blob(self, sha256: str) -> Path:
        return self.blobs / sha256[:2] / sha256

    def _manifest_path(self, digest: str) -> Path:
        return self.manifests / f"{digest}.json"

    def _ref_path(self, adapter_id: str) -> Path:
        return self.refs / _encode_id(adapter_id)

    # ------------------------------------------------------------ reading

    def _read_ref(self, adapter_id: str) -> str | None:
        try:
            return self._ref_path(adapter_id).read_text("ascii").strip()
        except FileNotFoundError:
            return None

    def _refs(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for entry in os.scandir(self.refs):
            adapter_id = _decode_id(entry.name)
            try:
                validate_adapter_id(adapter_id)
            except InvalidArgument:
                continue  # not a ref this store wrote
            digest = self._read_ref(adapter_id)
            if digest is not None:
                found[adapter_id] = digest
        return found

    def _load_manifest(self, digest: str) -> Manifest | None:
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
        manifest = self._load_manifest(digest) if digest is not None else None
        if manifest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        return manifest.with_id(adapter_id)

    def by_digest(self, digest: str) -> Manifest | None:
        """The committed manifest of a digest, under one of the ids referring to it; None if absent."""
        validate_digest(digest)
        manifest = self._load_manifest(digest)
        if manifest is None:
            return None
        if self._read_ref(manifest.adapter_id) == digest:
            return manifest
        ids = sorted(i for i, d in self._refs().items() if d == digest)
        return manifest.with_id(ids[0]) if ids else None

    def list(self) -> list[Manifest]:
        """Every committed adapter, sorted by id (partials and uploads are never listed)."""
        found = []
        for adapter_id, digest in sorted(self._refs().items()):
            manifest = self._load_manifest(digest)
            if manifest is not None:  # else unstaged while we listed
                found.append(manifest.with_id(adapter_id))
        return found

    def blob_path(self, sha256_hex: str) -> Path:
        """The path of a committed file by its sha256 (for Fetch serving and loading)."""
        validate_digest(sha256_hex, "file sha256")
        path = self._blob(sha256_hex)
        if not path.is_file():
            raise AdapterNotFound(f"no committed file with sha256 {sha256_hex} in this store")
        return path

    def verify(self, adapter_id: str) -> Manifest:
        """Re-hash an adapter's committed files against its manifest; ``IntegrityError`` on any difference."""
        manifest = self.get(adapter_id)
        for entry in manifest.files:
            hasher = FileHasher(entry.chunk_size)
            with open(self.blob_path(entry.sha256), "rb") as handle:
                for block in iter_file(handle):
                    hasher.update(block)
            if hasher.entry(entry.name) != entry:
                raise IntegrityError(f"adapter {adapter_id!r}: committed {entry.name} (sha256 {entry.sha256}) no longer matches its manifest")
        _check_header(manifest, self.blob_path(manifest.weights.sha256))
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
                os.link(self.blob_path(entry.sha256), building / entry.name)
            os.rename(building, view)
            _fsync_dir(self.views)
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
        if self._load_manifest(manifest.digest) is not None:
            with self._locked():
                if self._load_manifest(manifest.digest) is not None:
                    self._set_ref(adapter_id, manifest.digest)
                    return manifest
        self._check_quota(self._missing_bytes(manifest), f"staging {adapter_id!r}")
        sources = {manifest.files[0].sha256: self._temp_blob(manifest.config_json)}
        try:
            sources[manifest.weights.sha256] = self._copy_weights(weights_path, manifest)
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
                for block in iter_file(handle, _COPY_BLOCK):
                    hasher.update(block)
                    _pwrite_all(fd, block, hasher.size - len(block))
            if hasher.entry(WEIGHTS_FILE) != manifest.weights:
                raise IntegrityError(f"{source} changed while being staged (sha256 or size differs from the checked file)")
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
        """Install blobs (renaming ``sources``: sha256 -> temp file), manifest, then ref. True if the digest was already here.

        ``manifest_json``: ``manifest.to_json()`` when the caller has it already (~5 ms for Llama-3-8B shapes).

        Partials and uploads reserved their bytes when opened, so only staging
        re-checks the quota here (another writer may have taken the room).
        """
        with self._locked():
            existed = self._manifest_path(manifest.digest).is_file()
            if not existed:
                if check_quota:
                    self._check_quota(self._missing_bytes(manifest), f"staging {adapter_id!r}")
                for entry in manifest.files:
                    self._install_blob(entry.sha256, sources[entry.sha256])
                self._write_atomic(self._manifest_path(manifest.digest), manifest_json or manifest.to_json())
                self._cache[manifest.digest] = manifest
            self._set_ref(adapter_id, manifest.digest)
        return existed

    def _install_blob(self, sha256: str, source: Path) -> None:
        dest = self._blob(sha256)
        if dest.is_file():
            return  # same bytes already committed (another adapter shares this file)
        if not dest.parent.is_dir():
            dest.parent.mkdir()
            _fsync_dir(dest.parent.parent)
        os.chmod(source, 0o444)  # a hard link in a view must not let a loader change the blob
        os.rename(source, dest)
        _fsync_dir(dest.parent)

    def _set_ref(self, adapter_id: str, digest: str) -> None:
        """Point an id at a digest (under the lock); the previous digest's bytes go if nothing refers to them."""
        previous = self._read_ref(adapter_id)
        if previous == digest:
            return
        self._write_atomic(self._ref_path(adapter_id), digest.encode("ascii"))
        if previous is not None:
            self._collect()

    def unstage(self, adapter_id: str) -> bool:
        """Remove an id; True when its bytes were removed too (no other id refers to its digest)."""
        validate_adapter_id(adapter_id)
        with self._locked():
            digest = self._read_ref(adapter_id)
            if digest is None:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
            self._ref_path(adapter_id).unlink()
            _fsync_dir(self.refs)
            self._collect()
            return not self._manifest_path(digest).exists()

    def _collect(self) -> None:
        """Remove manifests, views and blobs no ref reaches (under the lock)."""
        live = set(self._refs().values())
        keep: set[str] = set()
        for entry in os.scandir(self.manifests):
            digest = entry.name.removesuffix(".json")
            if digest in live:
                keep.update(self._blob_shas(digest))
            else:
                os.unlink(entry.path)
                self._cache.pop(digest, None)
        for entry in os.scandir(self.views):
            if entry.name not in live:
                shutil.rmtree(entry.path, ignore_errors=True)
        for bucket in os.scandir(self.blobs):
            for blob in os.scandir(bucket.path):
                if blob.name not in keep:
                    os.unlink(blob.path)
        _fsync_dir(self.manifests)

    def _blob_shas(self, digest: str) -> list[str]:
        # Raw JSON, not Manifest.from_json: collection must not depend on a manifest still validating.
        try:
            raw = json.loads(self._manifest_path(digest).read_bytes())
            return [f["sha256"] for f in raw["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    # ------------------------------------------------------------ quota

    def usage(self) -> int:
        """Bytes held: committed blobs plus the declared size of every partial and upload."""
        total = 0
        for top in (self.blobs, self.partials, self.uploads):
            for dirpath, _, names in os.walk(top):
                for name in names:
                    try:
                        total += os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        pass
        return total

    def _missing_bytes(self, manifest: Manifest) -> int:
        return sum(f.size for f in manifest.files if not self._blob(f.sha256).is_file())

    def _check_adapter_size(self, size: int, what: str) -> None:
        if self.max_adapter_bytes is not None and size > self.max_adapter_bytes:
            raise LimitExceeded(
                f"{what}: the adapter is {size} bytes, over this node's limit of {self.max_adapter_bytes} (--max-adapter-bytes); nothing was written"
            )

    def _check_manifest_limits(self, manifest: Manifest) -> None:
        """A manifest (from a peer) must fit the size limits before a byte of it is fetched."""
        what = f"downloading {manifest.adapter_id!r}"
        self._check_adapter_size(sum(f.size for f in manifest.files), what)
        if manifest.header_size > self.max_header_bytes:
            raise InvalidHeader(
                f"{what}: its safetensors header is {manifest.header_size} bytes, over this node's limit of "
                f"{self.max_header_bytes} (--max-header-bytes); nothing was written"
            )

    def _check_quota(self, needed: int, what: str) -> None:
        if self.max_bytes is None or needed == 0:
            return
        used = self.usage()
        if used + needed > self.max_bytes:
            raise QuotaExceeded(
                f"{what} needs {needed} bytes but the store holds {used} of its {self.max_bytes}-byte limit "
                f"({used + needed - self.max_bytes} over); unstage adapters or raise the limit"
            )

    # ------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """After a crash or restart (under the lock): drop temp files and orphans, keep partials to resume."""
        for entry in os.scandir(self.tmp):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)  # views are built under the lock: never live here
                continue
            if _writer_alive(entry.name):
                # A temp blob is unlocked between its write and its rename into blobs/: the
                # lock alone cannot tell "abandoned" from "about to be installed".
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if _try_lock(fd):  # its writer is gone
                    os.unlink(entry.path)
            finally:
                os.close(fd)
        for entry in os.scandir(self.partials):
            name = entry.name
            committed = len(name) == 64 and self._manifest_path(name).is_file()
            if committed or not (Path(entry.path) / "manifest.json").is_file():
                _remove_if_unheld(Path(entry.path))
        for entry in os.scandir(self.uploads):
            if not (Path(entry.path) / "meta.json").is_file():
                _remove_if_unheld(Path(entry.path))
        self._collect()

    # ------------------------------------------------------------ peer downloads

    def open_partial(self, manifest: Manifest) -> "PartialDownload":
        """The download of ``manifest``'s weights, keyed by digest; resumes what an earlier one left verified."""
        with self._open_lock:
            current = self._open_partials.get(manifest.digest)
            if current is not None:
                if current.manifest.weights != manifest.weights:
                    raise InvalidArgument(
                        f"partial download of {manifest.digest} is open with chunk size {current.manifest.weights.chunk_size}, "
                        f"asked for {manifest.weights.chunk_size}"
                    )
                return current
            if self._load_manifest(manifest.digest) is not None:
                return PartialDownload(self, manifest, None)
            self._check_manifest_limits(manifest)
            directory = self.partials / manifest.digest
            if not (directory / "manifest.json").is_file():
                self._check_quota(self._missing_bytes(manifest), f"downloading {manifest.adapter_id!r}")
            lock_fd = _lock_held_dir(directory, f"partial download of {manifest.digest}")
            try:
                if self._load_manifest(manifest.digest) is not None:  # another process committed it meanwhile
                    os.close(lock_fd)
                    return PartialDownload(self, manifest, None)
                partial = PartialDownload(self, manifest, directory, lock_fd)
            except BaseException:
                os.close(lock_fd)
                raise
            self._open_partials[manifest.digest] = partial
            return partial

    def partial_for(self, digest: str) -> "PartialDownload | None":
        """The download of ``digest`` open in this store object, if any (to answer Availability and serve its verified chunks)."""
        with self._open_lock:
            return self._open_partials.get(digest)

    def _forget_partial(self, digest: str) -> None:
        with self._open_lock:
            self._open_partials.pop(digest, None)

    # ------------------------------------------------------------ client uploads

    def _upload_dir(self, adapter_id: str, sha256: str) -> Path:
        key = hashlib.sha256(f"{adapter_id}\0{sha256}".encode()).hexdigest()
        return self.uploads / key

    def upload_offset(self, adapter_id: str, sha256: str) -> int:
        """Bytes of an interrupted upload of (id, sha256) kept here; 0 when none."""
        validate_adapter_id(adapter_id)
        validate_digest(sha256, f"{WEIGHTS_FILE} sha256")
        with self._open_lock:
            current = self._open_uploads.get(self._upload_dir(adapter_id, sha256).name)
            if current is not None:
                return current.offset
        try:
            return os.stat(self._upload_dir(adapter_id, sha256) / "data").st_size
        except FileNotFoundError:
            return 0

    def open_upload(self, adapter_id: str, config_json: bytes, size: int, sha256: str) -> "Upload":
        """A client upload of a safetensors file; reopening the same (id, sha256) continues at ``offset``."""
        validate_adapter_id(adapter_id)
        validate_digest(sha256, f"{WEIGHTS_FILE} sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"upload of {adapter_id!r}: size {size!r} must be a non-negative integer")
        self._check_adapter_size(size + len(config_json), f"uploading {adapter_id!r}")
        PeftAdapterConfig.from_json_bytes(config_json)  # refuse a bad config before any byte moves
        directory = self._upload_dir(adapter_id, sha256)
        with self._open_lock:
            current = self._open_uploads.get(directory.name)
            if current is not None:
                if current.size != size:
                    raise InvalidArgument(f"upload of {adapter_id!r} is open with size {current.size}, asked for {size}")
                current.config_json = bytes(config_json)
                return current
            if not (directory / "meta.json").is_file():
                self._check_quota(size + len(config_json), f"uploading {adapter_id!r}")
            lock_fd = _lock_held_dir(directory, f"upload of {adapter_id!r} (sha256 {sha256})")
            try:
                upload = Upload(self, directory, lock_fd, adapter_id, bytes(config_json), size, sha256)
            except BaseException:
                os.close(lock_fd)
                raise
            self._open_uploads[directory.name] = upload
            return upload

    def _forget_upload(self, key: str) -> None:
        with self._open_lock:
            self._open_uploads.pop(key, None)


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that named a temp file ``<pid>-<hex>`` still runs (this one included)."""
    pid_text = temp_name.split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    if int(pid_text) == os.getpid():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_header(manifest: Manifest, path: Path) -> None:
    """The file's own header must be the one the manifest describes."""
    index = read_index(path)
    if index.header_size != manifest.header_size or index.tensors != manifest.tensors:
        raise IntegrityError(f"{path}: the safetensors header differs from the tensor index in the manifest of {manifest.digest}")


# ---------------------------------------------------------------- partial downloads


class PartialDownload:
    """The weights file of one adapter digest, arriving chunk by chunk; each chunk is verified before it is written.

    Progress is the data itself: reopening re-hashes what is on disk, so a
    chunk counts as verified only if its bytes match. Chunks are therefore not
    synced one by one (measured: an fdatasync per 1 MiB chunk cost ~100 ms of
    an 84 MB pull); their writeback is started as the file fills in order, so
    the fdatasync at ``commit`` has little left; ``close`` syncs the progress
    kept for a resume, and a chunk a power cut loses is simply fetched again.
    Once committed (or when the digest was already committed on open), reads
    come from the blob.

    The whole-file sha256 (invariant 8) is computed as chunks land, in file
    order (``InOrderHasher``), not by re-reading the file at commit. What it
    covers: each chunk range exactly once, in order, from the bytes this
    object wrote there (after verifying them), or read back from the file
    (out-of-order chunks not held in memory, and what a reopen found verified).
    Every chunk is written once and the size is fixed at open, so while only
    this object writes the file (its directory is flock'ed) the digest is the
    digest of the file on disk. A change by anyone else is caught:

    - at ``commit``, when the file's ctime, mtime or size differ from what
      they were after this object's last write: the whole file is then
      re-read and re-hashed (ctime cannot be set back from user space; a
      change in the same timestamp tick as our last write is the one case
      this misses, and kernels since 6.13 use fine-grained ctimes once
      observed, which we do after every write);
    - always on a reopen (resume), which re-hashes every chunk on disk.

    Not covered, here or for committed blobs: the device corrupting bytes
    below the page cache (``AdapterStore.verify`` re-reads a blob).
    """

    #: out-of-order chunks kept in memory for the running hash (the rest are read back from the page cache)
    hold_bytes = DEFAULT_HOLD_BYTES

    def __init__(self, store: AdapterStore, manifest: Manifest, directory: Path | None, lock_fd: int | None = None) -> None:
        self.store = store
        self.manifest = manifest
        self._lock = threading.Lock()
        self._directory = directory
        self._lock_fd = lock_fd
        self._fd: int | None = None
        weights = manifest.weights
        self._verified = bytearray(weights.chunk_count)
        self._prefix = 0  # chunks [0, _prefix) are all verified
        self._hasher = InOrderHasher(weights.chunk_count, self._verified.__getitem__, self._read_back, self.hold_bytes)
        self._written_stamp: tuple[int, int, int] | None = None  # (size, mtime, ctime) after our last write
        self._writeback_from = 0  # bytes [0, _writeback_from) have had their writeback started
        self._manifest_json = manifest.to_json() if directory is not None else b""  # once: reused at commit
        if directory is None:
            self._verified[:] = b"\1" * weights.chunk_count
            self._prefix = weights.chunk_count
        else:
            self._open_data()

    # ------------------------------------------------------------ opening

    def _open_data(self) -> None:
        weights = self.manifest.weights
        stored = self._directory / "manifest.json"
        if not stored.is_file() or stored.read_bytes() != self._manifest_json:
            self.store._write_atomic(stored, self._manifest_json)
        self._fd = os.open(self._directory / "data", os.O_RDWR | os.O_CREAT, 0o644)
        # Sparse, not fallocate'd (measured ~6 ms faster per 80 MB): chunks may land in any
        # order, a resume skips the holes, and the disk blocks held show the progress.
        if os.fstat(self._fd).st_size != weights.size:
            os.ftruncate(self._fd, weights.size)
        for index in range(weights.chunk_count):
            offset, length = weights.chunk_span(index)
            if self._has_data(offset, length):
                data = _pread_exact(self._fd, length, offset, f"partial {self.manifest.digest}")
                if hashlib.sha256(data).digest() == weights.chunk_sha256[index]:
                    self._verified[index] = 1
                    if index == self._hasher.next:  # the verified prefix: hashed now, while in hand
                        self._hasher.add(index, data)
        self._advance()
        self._stamp()

    def _has_data(self, offset: int, length: int) -> bool:
        """False when the range is a hole never written (saves hashing zeros on resume)."""
        try:
            return os.lseek(self._fd, offset, os.SEEK_DATA) < offset + length
        except OSError as exc:
            return exc.errno != errno.ENXIO  # ENXIO: no data after offset; other errors: just hash it

    def _advance(self) -> None:
        while self._prefix < len(self._verified) and self._verified[self._prefix]:
            self._prefix += 1

    def _stamp(self) -> None:
        st = os.fstat(self._fd)
        self._written_stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read_back(self, index: int) -> bytes:
        offset, length = self.manifest.weights.chunk_span(index)
        return _pread_exact(self._fd, length, offset, f"partial {self.manifest.digest}")

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

    def write_chunk(self, index: int, data: bytes | memoryview) -> None:
        """Verify chunk ``index`` against the manifest, then write it; a bad chunk writes nothing.

        ``data`` is written as given (a memoryview is not copied) and, when it
        is the next chunk in file order, folded into the whole-file sha256
        straight from memory.
        """
        self.manifest.weights.verify_chunk(index, data)  # outside the lock: workers verify in parallel
        with self._lock:
            if self._verified[index]:
                return
            self._require_open()
            offset = index * self.manifest.weights.chunk_size
            _pwrite_all(self._fd, data, offset)  # no fdatasync per chunk: see the class docstring
            self._stamp()
            self._verified[index] = 1
            self._advance()
            self._hasher.add(index, data)  # under the lock: in order, and the fd stays open for read-backs
            self._start_writeback()

    def _start_writeback(self) -> None:
        """Start writeback of what the in-order hash has passed, in runs of at least _WRITEBACK_RUN bytes."""
        weights = self.manifest.weights
        end = min(weights.size, self._hasher.next * weights.chunk_size)
        if end - self._writeback_from >= _WRITEBACK_RUN or (end == weights.size and end > self._writeback_from):
            _start_writeback(self._fd, self._writeback_from, end - self._writeback_from)
            self._writeback_from = end

    def read_chunk(self, index: int) -> bytes:
        """A verified chunk (re-checked on read: it may be served to other peers)."""
        weights = self.manifest.weights
        offset, length = weights.chunk_span(index)
        with self._lock:
            if not self._verified[index]:
                raise InvalidArgument(f"chunk {index} (offset {offset}) of {self.manifest.digest} is not verified here yet")
            self._require_open()  # a closed partial has no fd: say so, rather than a TypeError from pread
            if self._directory is None:
                with open(self.store.blob_path(weights.sha256), "rb") as handle:
                    handle.seek(offset)
                    data = handle.read(length)
            else:
                data = _pread_exact(self._fd, length, offset, f"partial {self.manifest.digest}")
        weights.verify_chunk(index, data)
        return data

    # ------------------------------------------------------------ finishing

    def commit(self, adapter_id: str) -> Manifest:
        """Whole-file check, then blobs, manifest and ref; the partial is gone afterwards."""
        validate_adapter_id(adapter_id)
        manifest = self.manifest.with_id(adapter_id)
        with self._lock:
            if self._directory is None:
                return self._commit_ref(manifest)
            self._require_open()
            self._check_complete()
            try:
                self._check_whole_file()
            except FabricError:
                self._discard_locked()
                raise
            os.fdatasync(self._fd)  # data and size; the rename into blobs/ is synced by _install_blob
            data_path = self._directory / "data"
            sources = {manifest.files[0].sha256: self.store._temp_blob(manifest.config_json), manifest.weights.sha256: data_path}
            try:
                same = manifest is self.manifest  # with_id returns self for the same id; to_json covers the id
                self.store._commit(manifest, adapter_id, sources, manifest_json=self._manifest_json if same else None)
            finally:
                sources[manifest.files[0].sha256].unlink(missing_ok=True)
            self._close_locked(remove=True)
        return manifest

    def _commit_ref(self, manifest: Manifest) -> Manifest:
        store = self.store
        with store._locked():
            if store._load_manifest(manifest.digest) is None or not all(store._blob(f.sha256).is_file() for f in manifest.files):
                raise AdapterNotFound(f"the bytes of {manifest.digest} were removed from this store before {manifest.adapter_id!r} referred to them; pull again")
            store._set_ref(manifest.adapter_id, manifest.digest)
        return manifest

    def _check_complete(self) -> None:
        if self.complete:
            return
        weights = self.manifest.weights
        missing = len(self._verified) - sum(self._verified)
        raise InvalidArgument(
            f"partial download of {self.manifest.digest} is incomplete: {missing} of {weights.chunk_count} chunks missing, "
            f"first is chunk {self._prefix} at offset {self._prefix * weights.chunk_size}"
        )

    def _check_whole_file(self) -> None:
        """The file's sha256 against the manifest: the running hash, or a full re-read if the file changed behind us."""
        weights = self.manifest.weights
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) == self._written_stamp:
            actual = self._hasher.finish()  # see the class docstring for what this covers
        else:
            actual = self._rehash()
        if actual != weights.sha256:
            raise IntegrityError(
                f"partial download of {self.manifest.digest}: every chunk verified but the whole {WEIGHTS_FILE} "
                f"has sha256 {actual}, not {weights.sha256} (the manifest's chunk digests disagree with it, "
                f"or the file was changed on disk after its chunks were verified)"
            )
        _check_header(self.manifest, self._directory / "data")

    def _rehash(self) -> str:
        weights = self.manifest.weights
        digest = hashlib.sha256()
        for offset in range(0, weights.size, _COPY_BLOCK):
            digest.update(_pread_exact(self._fd, min(_COPY_BLOCK, weights.size - offset), offset, f"partial {self.manifest.digest}"))
        return digest.hexdigest()

    def _require_open(self) -> None:
        if self._directory is not None and self._fd is None:
            raise InvalidArgument(f"partial download of {self.manifest.digest} was closed or discarded")

    def discard(self) -> None:
        """Drop the partial and its bytes (a committed adapter is not touched)."""
        with self._lock:
            self._discard_locked()

    def _discard_locked(self) -> None:
        if self._directory is not None and self._fd is not None:
            self._close_locked(remove=True, committed=False)

    def close(self) -> None:
        """Let go of the partial, keeping its verified bytes on disk (synced) for a later resume."""
        with self._lock:
            if self._directory is not None and self._fd is not None:
                os.fdatasync(self._fd)
                self._close_locked(remove=False, committed=False)

    def _close_locked(self, remove: bool, committed: bool = True) -> None:
        if remove:
            shutil.rmtree(self._directory, ignore_errors=True)
        os.close(self._fd)
        os.close(self._lock_fd)
        self._fd = self._lock_fd = None
        if committed:
            self._directory = None  # from now on reads come from the blob
        self.store._forget_partial(self.manifest.digest)


# ---------------------------------------------------------------- client uploads


class Upload:
    """A client's upload of a safetensors file, appended in order; nothing is committed until ``commit``."""

    def __init__(
        self, store: AdapterStore, directory: Path, lock_fd: int, adapter_id: str, config_json: bytes, size: int, sha256: str
    ) -> None:
        self.store = store
        self.adapter_id = adapter_id
        self.config_json = config_json
        self.size = size
        self.sha256 = sha256
        #: after commit: True when the same content was already committed
        self.already_staged = False
        self._directory = directory
        self._lock_fd: int | None = lock_fd
        self._lock = threading.Lock()
        meta = json.dumps({"adapter_id": adapter_id, "sha256": sha256, "size": size}, sort_keys=True).encode()
        meta_path = directory / "meta.json"
        fresh = not meta_path.is_file() or meta_path.read_bytes() != meta
        self._fd: int | None = os.open(directory / "data", os.O_RDWR | os.O_CREAT, 0o644)
        if fresh or os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            store._write_atomic(meta_path, meta)
        self._offset = os.fstat(self._fd).st_size

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
                    header_length(bytes(data[:8]), max_header_bytes=self.store.max_header_bytes)
                except InvalidHeader:
                    self._close_locked(remove=True)  # nothing to resume: the same bytes would be refused again
                    raise
            _pwrite_all(self._fd, data, offset)
            os.fdatasync(self._fd)
            self._offset += len(data)

    def commit(self) -> Manifest:
        """Check size, sha256, config, header and tensors, then commit; any failure commits nothing and drops the upload."""
        with self._lock:
            self._require_open()
            if self._offset != self.size:
                raise InvalidArgument(f"upload of {self.adapter_id!r} holds {self._offset} of {self.size} bytes: send the rest first")
            data_path = self._directory / "data"
            try:
                os.fsync(self._fd)
                manifest = build_manifest(
                    self.adapter_id, self.config_json, data_path, self.store.chunk_size, max_header_bytes=self.store.max_header_bytes
                )
                if manifest.weights.sha256 != self.sha256:
                    raise IntegrityError(
                        f"upload of {self.adapter_id!r}: received {self.size} bytes with sha256 {manifest.weights.sha256}, "
                        f"declared {self.sha256}"
                    )
                config_blob = self.store._temp_blob(self.config_json)
                try:
                    sources = {manifest.files[0].sha256: config_blob, manifest.weights.sha256: data_path}
                    self.already_staged = self.store._commit(manifest, self.adapter_id, sources)
                finally:
                    config_blob.unlink(missing_ok=True)
            except (InvalidAdapter, IntegrityError):
                self._close_locked(remove=True)
                raise
            self._close_locked(remove=True)
            return manifest

    def discard(self) -> None:
        with self._lock:
            if self._fd is not None:
                self._close_locked(remove=True)

    def close(self) -> None:
        """Let go of the upload, keeping its bytes for a later resume."""
        with self._lock:
            if self._fd is not None:
                self._close_locked(remove=False)

    def _require_open(self) -> None:
        if self._fd is None:
            raise InvalidArgument(f"upload of {self.adapter_id!r} was committed, closed or discarded")

    def _close_locked(self, remove: bool) -> None:
        if remove:
            shutil.rmtree(self._directory, ignore_errors=True)
        os.close(self._fd)
        os.close(self._lock_fd)
        self._fd = self._lock_fd = None
        self.store._forget_upload(self._directory.name)
