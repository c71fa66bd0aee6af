"""Files and directories named on the command line: read or made, and when that fails, said in words.

A user who typed a wrong path sees which argument, which path and what to do
(``--key nope.key: does not exist: give the private key fabric keygen wrote``),
never a Python exception's name and errno.
"""

from __future__ import annotations

import errno
from pathlib import Path

from adapter_fabric.errors import InvalidArgument

_REASONS = {
    errno.ENOENT: "does not exist",
    errno.EACCES: "is not open to this user (permission denied)",
    errno.EPERM: "is not open to this user (operation not permitted)",
    errno.EISDIR: "is a directory, where a file is expected",
    errno.ENOTDIR: "goes through something that is not a directory",
    errno.EROFS: "is on a read-only filesystem",
    errno.ENOSPC: "is on a full disk",
    errno.EEXIST: "exists already",
    errno.ENAMETOOLONG: "is too long a name",
}


def os_reason(exc: OSError) -> str:
    """What is wrong with the path an OSError names, in words (``does not exist``, ``is a directory, ...``)."""
    return _REASONS.get(exc.errno or 0) or (exc.strerror or "cannot be used").lower()


def os_problem(exc: OSError) -> str:
    """``PATH: what is wrong with it`` in words (the path from the error itself, when it names one)."""
    where = exc.filename if exc.filename is not None else "a file"
    return f"{where}: {os_reason(exc)}"


def read_input(path: str | Path, flag: str, fix: str) -> bytes:
    """The bytes of a file a flag names; ``InvalidArgument`` naming the flag, the path, the reason and ``fix`` otherwise."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {os_problem(exc)}: {fix}") from None


def make_directory(path: str | Path, flag: str) -> Path:
    """``path`` created (with its parents) for output; ``InvalidArgument`` naming the flag and what to give instead."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # mkdir's ENOENT means a directory above cannot hold it (gone, or a filesystem such as /proc), not that it is missing
        reason = "a directory above it does not exist or cannot hold directories" if exc.errno == errno.ENOENT else f"{exc.filename or path} {os_reason(exc)}"
        raise InvalidArgument(f"{flag} {path}: cannot create it ({reason}); give a path in a directory this user can write") from None
    return path


def writable_parent(path: str | Path, flag: str) -> None:
    """Refuse, naming ``flag``, a file path whose directory does not exist or is not a directory."""
    parent = Path(path).parent
    if not parent.is_dir():
        raise InvalidArgument(f"{flag} {path}: its directory {parent} does not exist: create it first, or give a path in an existing directory")
