"""File primitives for the store: positional reads and writes, writeback hints, id names, locks held by open descriptors.

Durable writes (sync, rename, sync the directory) are ``adapter_fabric.store.durable``'s.

Every helper here is about one file or directory; none knows the store's layout.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
from pathlib import Path

from adapter_fabric.errors import IntegrityError, InvalidArgument, QuotaExceeded
from adapter_fabric.format.safetensors_index import MAX_HEADER_BYTES, header_matches, read_index
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.stamps import FileStamp, file_stamp

COPY_BLOCK = 1 << 20
WRITEBACK_RUN = 8 << 20  # start a partial's writeback in runs this long (one call per ~8 chunks)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
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


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range out now, so the fdatasync at commit finds little left (a hint: errors surface there)."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def write_stamp(fd: int) -> FileStamp:
    """The stamp of an open file, taken after each of our writes: a different one later means another writer."""
    return file_stamp(fd)


def has_data(fd: int, offset: int, length: int) -> bool:
    """False when the range of a sparse file is a hole never written (saves hashing zeros on a resume)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) < offset + length
    except OSError as exc:
        return exc.errno != errno.ENXIO  # ENXIO: no data after offset; other errors: just hash it


def pread_exact(fd: int, length: int, offset: int, what: str) -> bytes:
    parts, got = [], 0
    while got < length:
        block = os.pread(fd, length - got, offset + got)
        if not block:
            raise IntegrityError(f"{what}: file ends at offset {offset + got}, {length - got} bytes short")
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def encode_id(adapter_id: str) -> str:
    # "%" is outside the id alphabet, so this is reversible and never nests directories.
    return adapter_id.replace("/", "%2F")


def decode_id(name: str) -> str:
    return name.replace("%2F", "/")


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_held_dir(directory: Path, what: str) -> int:
    """Create ``directory`` if needed and hold ``directory/lock``; the fd keeps the hold."""
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # removed by a cleaner between mkdir and open
            continue
        if not try_lock(fd):
            os.close(fd)
            raise InvalidArgument(f"{what} is open in another process or store object; close it there or retry later")
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)  # a cleaner removed the directory while we waited: start again


def remove_if_unheld(directory: Path) -> bool:
    """Remove a partial/upload directory unless a live owner holds its lock."""
    try:
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        return True
    try:
        if not try_lock(fd):
            return False
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def writer_alive(temp_name: str) -> bool:
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


def check_header(manifest: Manifest, path: Path) -> None:
    """The file's own header must be the one the manifest describes (refusals name the adapter, not the node's path).

    Its bytes are compared with the manifest's entries first (``header_matches``); only a header that differs is parsed
    whole, for the refusal that names why."""
    what = f"the weights of {manifest.adapter_id!r} ({manifest.digest})"
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n == manifest.header_size and n <= MAX_HEADER_BYTES:  # else it differs (or is over the bound): parse it, to say how
            head += f.read(manifest.header_size)
            if header_matches(head, manifest.tensors, os.fstat(f.fileno()).st_size):
                return
    index = read_index(path, name=what)
    if index.header_size != manifest.header_size or index.tensors != manifest.tensors:
        raise IntegrityError(f"{what}: the safetensors header differs from the tensor index in its manifest")
