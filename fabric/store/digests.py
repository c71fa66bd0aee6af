"""File digests: the chunk plan, per-chunk and whole-file hashes, a file's entry, and the adapter digest."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from fabric.errors import IntegrityError, InvalidAdapter, InvalidArgument
from fabric.store.ids import validate_digest
from fabric.v1 import fabric_pb2

DEFAULT_CHUNK_SIZE = 1 << 20
#: The wire carries chunk_size as uint32; 1 GiB keeps one chunk in memory reasonable.
MAX_CHUNK_SIZE = 1 << 30
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FILE_NAMES = (CONFIG_FILE, WEIGHTS_FILE)
_DIGEST_TAG = b"adapter-fabric adapter digest v1\0"
_U64_MAX = (1 << 64) - 1


def plan_chunks(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of every chunk of a file: all ``chunk_size`` long but the last; none for an empty file."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"file size {size!r} must be a non-negative integer")
    check_chunk_size(chunk_size)
    return [(offset, min(chunk_size, size - offset)) for offset in range(0, size, chunk_size)]


def adapter_digest(config_sha256: str, weights_sha256: str) -> str:
    """The adapter digest from both file digests (see the module docstring: it is the wire contract)."""
    validate_digest(config_sha256, f"{CONFIG_FILE} sha256")
    validate_digest(weights_sha256, f"{WEIGHTS_FILE} sha256")
    material = _DIGEST_TAG + config_sha256.encode("ascii") + b"\0" + weights_sha256.encode("ascii")
    return hashlib.sha256(material).hexdigest()


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidArgument(f"chunk size {chunk_size!r} must be an integer from 1 to {MAX_CHUNK_SIZE}")


class FileHasher:
    """Whole-file and per-chunk sha256 of bytes fed in order, in one pass."""

    def __init__(self, chunk_size: int) -> None:
        check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.size = 0
        self._whole = hashlib.sha256()
        self._chunk = hashlib.sha256()
        self._in_chunk = 0
        self._chunks: list[bytes] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self._whole.update(view)
        self.size += len(view)
        while view:
            take = min(len(view), self.chunk_size - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_size:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self._chunks.append(self._chunk.digest())
        self._chunk = hashlib.sha256()
        self._in_chunk = 0

    def entry(self, name: str) -> "FileEntry":
        if self._in_chunk:
            self._close_chunk()
        return FileEntry(name, self.size, self._whole.hexdigest(), self.chunk_size, tuple(self._chunks))


def iter_file(handle: BinaryIO, block: int = 1 << 20) -> Iterator[bytes]:
    """The blocks of an open binary file, from its current position to the end."""
    while True:
        data = handle.read(block)
        if not data:
            return
        yield data


def hash_bytes(name: str, data: bytes, chunk_size: int) -> "FileEntry":
    hasher = FileHasher(chunk_size)
    hasher.update(data)
    return hasher.entry(name)


def hash_file(name: str, path: str | Path, chunk_size: int) -> "FileEntry":
    hasher = FileHasher(chunk_size)
    with open(path, "rb") as handle:
        for block in iter_file(handle):
            hasher.update(block)
    return hasher.entry(name)


# ---------------------------------------------------------------- file entries


@dataclass(frozen=True)
class FileEntry:
    """One file of an adapter: its size, sha256 and the sha256 of every chunk."""

    name: str
    size: int
    sha256: str
    chunk_size: int
    chunk_sha256: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.name not in FILE_NAMES:
            raise InvalidAdapter(f"file name {self.name!r} is not one of {', '.join(FILE_NAMES)}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 0 <= self.size <= _U64_MAX:
            raise InvalidAdapter(f"{self.name}: size {self.size!r} must be a non-negative integer")
        try:
            validate_digest(self.sha256, f"{self.name} sha256")
            check_chunk_size(self.chunk_size)
        except InvalidArgument as exc:
            raise InvalidAdapter(str(exc)) from None
        expected = -(-self.size // self.chunk_size)
        if len(self.chunk_sha256) != expected:
            raise IntegrityError(
                f"{self.name}: {len(self.chunk_sha256)} chunk digests for {self.size} bytes "
                f"in chunks of {self.chunk_size}: expected {expected}"
            )
        for index, digest in enumerate(self.chunk_sha256):
            if not isinstance(digest, bytes) or len(digest) != 32:
                raise InvalidAdapter(f"{self.name}: chunk {index} digest is not 32 raw bytes")

    @property
    def chunk_count(self) -> int:
        return len(self.chunk_sha256)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.chunk_count:
            raise InvalidArgument(f"{self.name}: chunk index {index!r} is out of range (the file has {self.chunk_count} chunks)")
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def verify_chunk(self, index: int, data: bytes | memoryview) -> None:
        """Raise ``IntegrityError`` unless ``data`` is exactly chunk ``index`` of this file."""
        offset, length = self.chunk_span(index)
        if len(data) != length:
            raise IntegrityError(
                f"{self.name}: chunk {index} at offset {offset} has {len(data)} bytes, expected {length}"
            )
        if hashlib.sha256(data).digest() != self.chunk_sha256[index]:
            raise IntegrityError(
                f"{self.name}: chunk {index} at offset {offset} ({length} bytes) does not match its sha256"
            )

    def to_proto(self) -> fabric_pb2.FileEntry:
        return fabric_pb2.FileEntry(
            name=self.name, size=self.size, sha256=self.sha256, chunk_size=self.chunk_size, chunk_sha256=list(self.chunk_sha256)
        )

    @classmethod
    def from_proto(cls, pb: fabric_pb2.FileEntry) -> "FileEntry":
        return cls(pb.name, pb.size, pb.sha256, pb.chunk_size, tuple(bytes(d) for d in pb.chunk_sha256))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "sha256": self.sha256,
            "chunk_size": self.chunk_size,
            "chunk_sha256": [d.hex() for d in self.chunk_sha256],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "FileEntry":
        try:
            chunks = tuple(bytes.fromhex(d) for d in raw["chunk_sha256"])
            return cls(raw["name"], raw["size"], raw["sha256"], raw["chunk_size"], chunks)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidAdapter(f"manifest file entry is malformed: {exc!r}") from None


# ---------------------------------------------------------------- manifests
