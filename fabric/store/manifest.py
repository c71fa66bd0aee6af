"""The manifest of a staged adapter: its files, sizes, digests, chunks and tensor index.

A manifest is everything a node needs to decide, before moving a byte, whether
an adapter fits (config, tensor index) and to verify every byte it receives
(one BLAKE3 per chunk, under each file's root). A ``Manifest`` checks itself
on construction, so one read from a peer or from disk that lies about a size,
a digest, a root or its content id never exists as an object.

The adapter digest (the name of an adapter's content, on the wire and on
disk) is defined in ``adapter_fabric.store.digests``: BLAKE3 over both files' roots.
Two adapters share a digest exactly when both files are byte-for-byte equal
and chunked alike.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

from adapter_fabric.errors import IncompatibleFormat, IntegrityError, InvalidAdapter, InvalidArgument, InvalidHeader
from adapter_fabric.format.adapter_tensors import LoraPair, lora_pairs
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.content_id import content_id as compute_content_id
from adapter_fabric.format.peft_fields import peft_fields_of
from adapter_fabric.format.safetensors_index import MAX_HEADER_BYTES, SafetensorsIndex, TensorInfo, check_entries, check_layout, read_index
from adapter_fabric.store.digests import (  # re-exported: the manifest is where callers look for them
    CONFIG_FILE,
    DEFAULT_CHUNK_SIZE,
    DIGEST_SCHEME,
    FILE_NAMES,
    MAX_CHUNK_SIZE,
    WEIGHTS_FILE,
    FileEntry,
    FileHasher,
    adapter_digest,
    check_chunk_size,
    check_scheme,
    hash_bytes,
    hash_file,
    iter_file,
    plan_chunks,
)
from adapter_fabric.store.ids import validate_adapter_id, validate_digest
from adapter_fabric.v1 import fabric_pb2

__all__ = ["CONFIG_FILE", "DEFAULT_CHUNK_SIZE", "DIGEST_SCHEME", "FILE_NAMES", "MAX_CHUNK_SIZE", "WEIGHTS_FILE", "FileEntry", "FileHasher", "Manifest",
           "adapter_digest", "build_manifest", "hash_bytes", "hash_file", "iter_file", "manifest_of", "manifest_request", "plan_chunks"]

#: the on-disk JSON form's version: 2 = digest scheme 2 (format 1 held scheme-1 sha256 digests)
_JSON_FORMAT = 2


@dataclass(frozen=True)
class Manifest:
    """A staged adapter: its id, digest, content id, files, config bytes and tensor index.

    Construction checks every claim that can be checked without the weights
    bytes: the id, each digest's form, chunk counts against sizes, the config
    file entry against ``config_json``, the digest against the file digests,
    the tensor index against the weights size and the config, and the content
    id recomputed from all of it.
    """

    adapter_id: str
    digest: str
    content_id: int
    files: tuple[FileEntry, ...]
    config_json: bytes
    tensors: tuple[TensorInfo, ...]
    header_size: int
    # Derived in __post_init__ (kept off repr/eq: they follow from the fields).
    modules: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    pairs: Mapping[str, LoraPair] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_adapter_id(self.adapter_id)
        try:
            validate_digest(self.digest, f"adapter {self.adapter_id!r} digest")
        except InvalidArgument as exc:
            raise InvalidAdapter(str(exc)) from None
        names = tuple(f.name for f in self.files)
        if names != FILE_NAMES:
            raise InvalidAdapter(f"adapter {self.adapter_id!r}: files {list(names)} must be exactly {list(FILE_NAMES)}")
        self._check_config_file()
        expected = adapter_digest(self.files[0].root, self.files[1].root)
        if self.digest != expected:
            raise IntegrityError(f"adapter {self.adapter_id!r}: digest {self.digest} does not match its files (expected {expected})")
        pairs = lora_pairs(self.index, self.config)
        modules = tuple(sorted(pairs))
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "pairs", MappingProxyType(pairs))  # the LoRA pairs, checked once (every promote reads them)
        cid = compute_content_id(self.weights.root, self.config, modules)
        if self.content_id != cid:
            raise IntegrityError(f"adapter {self.adapter_id!r}: content_id {self.content_id} does not match its bytes and scaling (expected {cid})")

    def _check_config_file(self) -> None:
        if not isinstance(self.config_json, bytes):
            raise InvalidAdapter(f"adapter {self.adapter_id!r}: config_json must be bytes")
        entry = self.files[0]
        actual = hash_bytes(CONFIG_FILE, self.config_json, entry.chunk_size)
        if actual != entry:
            raise IntegrityError(
                f"adapter {self.adapter_id!r}: {CONFIG_FILE} entry (size {entry.size}, root {entry.root}) "
                f"does not match config_json ({actual.size} bytes, root {actual.root})"
            )

    # ------------------------------------------------------------- views

    @cached_property
    def config(self) -> PeftAdapterConfig:
        return PeftAdapterConfig.from_json_bytes(self.config_json)

    @property
    def weights(self) -> FileEntry:
        """The safetensors file's entry."""
        return self.files[1]

    @cached_property
    def index(self) -> SafetensorsIndex:
        """The weights' safetensors index as the manifest claims it (checked against the size)."""
        return _claimed_index(self.adapter_id, self.header_size, self.tensors, self.weights.size)

    @property
    def total_size(self) -> int:
        """Bytes of every file of the adapter."""
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry:
        """The entry of a file by name (``InvalidAdapter`` naming it when absent)."""
        for entry in self.files:
            if entry.name == name:
                return entry
        raise InvalidArgument(f"adapter {self.adapter_id!r} has no file {name!r} (files: {', '.join(FILE_NAMES)})")

    def with_id(self, adapter_id: str) -> Manifest:
        """The same manifest under another adapter id (the digest does not depend on the id: nothing else is re-checked)."""
        if adapter_id == self.adapter_id:
            return self
        renamed = copy.copy(self)
        object.__setattr__(renamed, "adapter_id", validate_adapter_id(adapter_id))
        return renamed

    # ------------------------------------------------------------- proto

    def to_proto(self) -> fabric_pb2.Manifest:
        """The wire form (``fabric.v1.Manifest``)."""
        return fabric_pb2.Manifest(
            adapter_id=self.adapter_id,
            digest=self.digest,
            content_id=self.content_id,
            files=[f.to_proto() for f in self.files],
            config_json=self.config_json,
            peft=peft_fields_of(self.config),
            tensors=[
                fabric_pb2.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), begin=t.begin, end=t.end)
                for t in self.tensors
            ],
            header_size=self.header_size,
            digest_scheme=DIGEST_SCHEME,
        )

    @classmethod
    def from_proto(cls, pb: fabric_pb2.Manifest) -> Manifest:
        """A manifest from the wire, every claim checked (see the class docstring); another digest scheme is ``IncompatibleFormat``."""
        check_scheme(pb.digest_scheme, f"the manifest of {pb.adapter_id[:200]!r}")
        manifest = cls(
            adapter_id=pb.adapter_id,
            digest=pb.digest,
            content_id=pb.content_id,
            files=tuple(FileEntry.from_proto(f) for f in pb.files),
            config_json=bytes(pb.config_json),
            tensors=tuple(
                TensorInfo(name=t.name, dtype=t.dtype, shape=tuple(t.shape), begin=t.begin, end=t.end) for t in pb.tensors
            ),
            header_size=pb.header_size,
        )
        # peft is derived from config_json; a sender that fills it must agree.
        if pb.HasField("peft") and pb.peft != peft_fields_of(manifest.config):
            raise IntegrityError(f"adapter {pb.adapter_id!r}: the peft fields disagree with config_json")
        return manifest

    # ------------------------------------------------------------- json

    def to_json(self) -> bytes:
        """The store's on-disk form (canonical JSON: sorted keys, no whitespace)."""
        raw = {
            "format": _JSON_FORMAT,
            "adapter_id": self.adapter_id,
            "digest": self.digest,
            "content_id": self.content_id,
            "files": [f.to_dict() for f in self.files],
            "config_json": base64.b64encode(self.config_json).decode("ascii"),
            "header_size": self.header_size,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "begin": t.begin, "end": t.end} for t in self.tensors
            ],
        }
        # Compact: json's C encoder does not indent, and the pure-Python one took ~5 ms per pull of a 448-tensor adapter.
        return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            if raw.get("format") == 1:
                raise IncompatibleFormat(f"manifest format 1 holds digest scheme 1 (sha256); this version reads format {_JSON_FORMAT} (scheme {DIGEST_SCHEME})")
            if raw.get("format") != _JSON_FORMAT:
                raise ValueError(f"format {raw.get('format')!r} is not {_JSON_FORMAT}")
            files = tuple(FileEntry.from_dict(f) for f in raw["files"])
            tensors = tuple(
                TensorInfo(name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"]), begin=t["begin"], end=t["end"])
                for t in raw["tensors"]
            )
            config_json = base64.b64decode(raw["config_json"], validate=True)
            fields = (raw["adapter_id"], raw["digest"], raw["content_id"], raw["header_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidAdapter(f"manifest JSON is malformed: {exc}") from None
        adapter_id, digest, cid, header_size = fields
        return cls(adapter_id, digest, cid, files, config_json, tensors, header_size)


def manifest_request(adapter_id: str, *, with_sha256: bool = False) -> fabric_pb2.GetManifestRequest:
    """A GetManifest request that says this node's digest scheme (a node of another scheme refuses it by name)."""
    return fabric_pb2.GetManifestRequest(adapter_id=adapter_id, digest_scheme=DIGEST_SCHEME, with_sha256=with_sha256)


def _claimed_index(adapter_id: str, header_size: int, tensors: tuple[TensorInfo, ...], weights_size: int) -> SafetensorsIndex:
    """A ``SafetensorsIndex`` from a manifest's claims: held to the header parser's checks, and adding up to the file size.

    Each entry is checked as the parser checks one (``check_entries``; this took a JSON round trip through the parser
    before, ~5 ms of each pull of a 448-tensor adapter), then the order the parser sorts them in, then the layout."""
    if isinstance(header_size, bool) or not isinstance(header_size, int) or header_size < 2:
        raise InvalidAdapter(f"adapter {adapter_id!r}: header_size {header_size!r} is not a safetensors header length")
    try:
        check_entries(tensors)
    except InvalidHeader as exc:
        raise InvalidHeader(f"adapter {adapter_id!r}: the manifest's tensor index is invalid: {exc}") from None
    if len({t.name for t in tensors}) != len(tensors) or list(tensors) != sorted(tensors, key=lambda t: (t.begin, t.end, t.name)):
        raise InvalidAdapter(f"adapter {adapter_id!r}: the manifest's tensors are duplicated or not in offset order")
    try:
        check_layout(tensors)
    except InvalidHeader as exc:
        raise InvalidHeader(f"adapter {adapter_id!r}: the manifest's tensor index is invalid: {exc}") from None
    index = SafetensorsIndex(header_size=header_size, tensors=tuple(tensors), metadata={})
    if index.file_size != weights_size:
        raise IntegrityError(
            f"adapter {adapter_id!r}: {WEIGHTS_FILE} is {weights_size} bytes but its index "
            f"(8 + header {header_size} + data {index.data_size}) adds up to {index.file_size}"
        )
    return index


# ---------------------------------------------------------------- building


def build_manifest(
    adapter_id: str, config_json: bytes, weights_path: str | Path, chunk_size: int = DEFAULT_CHUNK_SIZE, *, max_header_bytes: int = MAX_HEADER_BYTES
) -> Manifest:
    """Validate an adapter's config and weights file and describe them, reading the weights once."""
    validate_adapter_id(adapter_id)
    check_chunk_size(chunk_size)
    PeftAdapterConfig.from_json_bytes(config_json)  # a bad config or header is refused before the weights are read
    index = read_index(weights_path, max_header_bytes=max_header_bytes)
    return manifest_of(adapter_id, config_json, hash_file(WEIGHTS_FILE, weights_path, chunk_size), index)


def manifest_of(adapter_id: str, config_json: bytes, weights: FileEntry, index: SafetensorsIndex) -> Manifest:
    """The manifest of a config and a weights file already hashed (``weights``) and indexed (``index``, its header)."""
    config = PeftAdapterConfig.from_json_bytes(config_json)
    if weights.size != index.file_size:
        raise IntegrityError(f"{WEIGHTS_FILE}: {weights.size} bytes, but its header describes {index.file_size}")
    modules = tuple(sorted(lora_pairs(index, config)))
    files = (hash_bytes(CONFIG_FILE, config_json, weights.chunk_size), weights)
    return Manifest(
        adapter_id=adapter_id,
        digest=adapter_digest(files[0].root, weights.root),
        content_id=compute_content_id(weights.root, config, modules),
        files=files,
        config_json=bytes(config_json),
        tensors=index.tensors,
        header_size=index.header_size,
    )
