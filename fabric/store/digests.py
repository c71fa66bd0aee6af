"""File digests (scheme 2): the chunk plan, per-chunk BLAKE3, a file's root, its entry, and the adapter digest.

The wire contract (``DigestScheme.DIGEST_SCHEME_BLAKE3_CHUNKS`` in the .proto)::

    chunk digest  = BLAKE3(chunk bytes)                                  32 raw bytes
    file root     = BLAKE3(b"adapter-fabric file root v2\\0"
                           + u64le(size) + u32le(chunk_size) + chunk digests...).hexdigest()
    adapter digest = BLAKE3(b"adapter-fabric adapter digest v2\\0"
                           + config root + b"\\0" + weights root).hexdigest()   (roots as hex ASCII)

A ``FileEntry`` recomputes its root from its chunk digests when it is built,
so an entry that exists is self-consistent: checking every chunk of a file
against its entry *is* checking the whole file, in one pass and in any order.
Scheme 1 needed a second, in-order sha256 pass, since per-chunk sha256s
cannot be combined into a file's sha256.

The chunk size is part of an adapter's identity (a torrent's piece length is
too): the stager's node chooses it (``--chunk-size``, 1 MiB by default) and a
pull keeps the seeder's chunking, so every copy of pulled bytes has one digest.
The plain BLAKE3 of a whole file (what ``b3sum`` prints), independent of
chunking, keys and checks client uploads (``whole_file_blake3``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from blake3 import blake3

from adapter_fabric.errors import IncompatibleFormat, IntegrityError, InvalidAdapter, InvalidArgument
from adapter_fabric.format.config import CONFIG_FILE  # defined once, where the adapter format lives
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.v1 import fabric_pb2

#: the scheme this version computes, reads and writes (the .proto's DigestScheme)
DIGEST_SCHEME = fabric_pb2.DIGEST_SCHEME_BLAKE3_CHUNKS
DEFAULT_CHUNK_SIZE = 1 << 20
#: The wire carries chunk_size as uint32; 1 GiB keeps one chunk in memory reasonable.
MAX_CHUNK_SIZE = 1 << 30
WEIGHTS_FILE = "adapter_model.safetensors"
FILE_NAMES = (CONFIG_FILE, WEIGHTS_FILE)
_FILE_TAG = b"adapter-fabric file root v2\0"
_DIGEST_TAG = b"adapter-fabric adapter digest v2\0"
_U64_MAX = (1 << 64) - 1
#: inputs at least this long are hashed on BLAKE3's own threads (the GIL is released either way)
_THREADED_BYTES = 8 << 20


def check_scheme(scheme: int, what: str) -> None:
    """Refuse, naming both versions, a message or store of another digest scheme (``IncompatibleFormat``)."""
    if scheme != DIGEST_SCHEME:
        known: dict[int, object] = {fabric_pb2.DIGEST_SCHEME_UNSPECIFIED: "1 (sha256: it predates the field)", fabric_pb2.DIGEST_SCHEME_SHA256: "1 (sha256)"}
        raise IncompatibleFormat(
            f"{what} uses digest scheme {known.get(scheme, scheme)}; this node reads and writes scheme {DIGEST_SCHEME} "
            f"(BLAKE3 chunk trees): run the same version of adapter-fabric on both ends"
        )


def plan_chunks(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of every chunk of a file: all ``chunk_size`` long but the last; none for an empty file."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"file size {size!r} must be a non-negative integer")
    check_chunk_size(chunk_size)
    return [(offset, min(chunk_size, size - offset)) for offset in range(0, size, chunk_size)]


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidArgument(f"chunk size {chunk_size!r} must be an integer from 1 to {MAX_CHUNK_SIZE}")


def chunk_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte BLAKE3 of one chunk (the GIL is released while it hashes)."""
    return blake3(data, max_threads=blake3.AUTO if len(data) >= _THREADED_BYTES else 1).digest()


def file_root(size: int, chunk_size: int, chunk_digests: tuple[bytes, ...] | list[bytes]) -> str:
    """The hex root of a file from its size, chunk size and chunk digests (the module docstring's definition)."""
    hasher = blake3(_FILE_TAG + struct.pack("<QI", size, chunk_size))
    hasher.update(b"".join(chunk_digests))
    return hasher.hexdigest()


def adapter_digest(config_root: str, weights_root: str) -> str:
    """The adapter digest from both file roots (see the module docstring: it is the wire contract)."""
    validate_digest(config_root, f"{CONFIG_FILE} root")
    validate_digest(weights_root, f"{WEIGHTS_FILE} root")
    return blake3(_DIGEST_TAG + config_root.encode("ascii") + b"\0" + weights_root.encode("ascii")).hexdigest()


def whole_file_blake3(path: str | Path) -> str:
    """The plain BLAKE3 of a file, as ``b3sum`` prints it (memory-mapped, on BLAKE3's threads)."""
    hasher = blake3(max_threads=blake3.AUTO)
    if Path(path).stat().st_size:
        hasher.update_mmap(path)
    return hasher.hexdigest()


class FileHasher:
    """Chunk digests of bytes fed in order, in whatever pieces they come: each byte is hashed once."""

    def __init__(self, chunk_size: int) -> None:
        check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.size = 0
        self._chunk = blake3()
        self._in_chunk = 0
        self._chunks: list[bytes] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.size += len(view)
        while view:
            take = min(len(view), self.chunk_size - self._in_chunk)
            if self._in_chunk == 0 and take == self.chunk_size:
                self._chunks.append(chunk_digest(view[:take]))  # a whole chunk in hand: no streaming state
            else:
                self._chunk.update(view[:take])
                self._in_chunk += take
                if self._in_chunk == self.chunk_size:
                    self._close_chunk()
            view = view[take:]

    def _close_chunk(self) -> None:
        self._chunks.append(self._chunk.digest())
        self._chunk = blake3()
        self._in_chunk = 0

    def entry(self, name: str) -> FileEntry:
        if self._in_chunk:
            self._close_chunk()
        digests = tuple(self._chunks)
        return FileEntry(name, self.size, file_root(self.size, self.chunk_size, digests), self.chunk_size, digests)


def iter_file(handle: BinaryIO, block: int = 1 << 20) -> Iterator[bytes]:
    """The blocks of an open binary file, from its current position to the end."""
    while True:
        data = handle.read(block)
        if not data:
            return
        yield data


def hash_bytes(name: str, data: bytes | bytearray | memoryview, chunk_size: int) -> FileEntry:
    hasher = FileHasher(chunk_size)
    hasher.update(data)
    return hasher.entry(name)


def hash_file(name: str, path: str | Path, chunk_size: int) -> FileEntry:
    """The entry of a file on disk, read in whole chunks (one read and one hash call per chunk)."""
    hasher = FileHasher(chunk_size)
    with open(path, "rb") as handle:
        for block in iter_file(handle, max(chunk_size, 1 << 20) // chunk_size * chunk_size):
            hasher.update(block)
    return hasher.entry(name)


# ---------------------------------------------------------------- file entries


@dataclass(frozen=True)
class FileEntry:
    """One file of an adapter: its size, chunk size, the BLAKE3 of every chunk, and the root over them.

    Construction recomputes the root from the chunk digests (``IntegrityError``
    when they disagree), so every chunk verified against an entry is a piece
    of the one file its root names.
    """

    name: str
    size: int
    root: str
    chunk_size: int
    chunk_digests: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.name not in FILE_NAMES:
            raise InvalidAdapter(f"file name {self.name!r} is not one of {', '.join(FILE_NAMES)}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 0 <= self.size <= _U64_MAX:
            raise InvalidAdapter(f"{self.name}: size {self.size!r} must be a non-negative integer")
        try:
            validate_digest(self.root, f"{self.name} root")
            check_chunk_size(self.chunk_size)
        except InvalidArgument as exc:
            raise InvalidAdapter(str(exc)) from None
        expected = -(-self.size // self.chunk_size)
        if len(self.chunk_digests) != expected:
            raise IntegrityError(
                f"{self.name}: {len(self.chunk_digests)} chunk digests for {self.size} bytes "
                f"in chunks of {self.chunk_size}: expected {expected}"
            )
        for index, digest in enumerate(self.chunk_digests):
            if not isinstance(digest, bytes) or len(digest) != 32:
                raise InvalidAdapter(f"{self.name}: chunk {index} digest is not 32 raw bytes")
        actual = file_root(self.size, self.chunk_size, self.chunk_digests)
        if actual != self.root:
            raise IntegrityError(f"{self.name}: root {self.root} does not match its chunk digests (they give {actual})")

    @property
    def chunk_count(self) -> int:
        return len(self.chunk_digests)

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
        if chunk_digest(data) != self.chunk_digests[index]:
            raise IntegrityError(
                f"{self.name}: chunk {index} at offset {offset} ({length} bytes) does not match its digest"
            )

    def to_proto(self) -> fabric_pb2.FileEntry:
        return fabric_pb2.FileEntry(
            name=self.name, size=self.size, root=self.root, chunk_size=self.chunk_size, chunk_digests=list(self.chunk_digests)
        )

    @classmethod
    def from_proto(cls, pb: fabric_pb2.FileEntry) -> FileEntry:
        return cls(pb.name, pb.size, pb.root, pb.chunk_size, tuple(bytes(d) for d in pb.chunk_digests))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "root": self.root,
            "chunk_size": self.chunk_size,
            "chunk_digests": b"".join(self.chunk_digests).hex(),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FileEntry:
        try:
            packed = bytes.fromhex(raw["chunk_digests"])
            chunks = tuple(packed[i : i + 32] for i in range(0, len(packed), 32))
            return cls(raw["name"], raw["size"], raw["root"], raw["chunk_size"], chunks)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidAdapter(f"manifest file entry is malformed: {exc!r}") from None

