"""Where everything of a store lives on disk: paths only, no I/O beyond creating the directories.

Layout under ``root`` (after Uber Kraken: uploads and downloads in progress
live apart from the content-addressed cache, and partial data never shares a
directory with committed data)::

    format                        "2": the store format (digest scheme 2); absent in a new root until created
    lock                          flock'ed around every metadata change (adapter_fabric.store.committer)
    blobs/blake3/<2 hex>/<root>   committed files, named by their root (adapter_fabric.store.digests), read-only
    manifests/<digest>.json       one manifest per adapter digest (Manifest.to_json)
    refs/<id>                     adapter id -> digest; "/" in an id is written "%2F"
    partial/<digest>/             a peer download: data (sparse), manifest.json, lock
    uploads/<key>/                a client upload: data, meta.json, lock; key = sha256(id, whole-file BLAKE3)
    views/<digest>/               materialized PEFT directories: hard links into blobs
    signatures/<digest>           the author's Ed25519 signature of a digest, when it was signed (adapter_fabric.trust)
    quarantine/<root>-<ns>        blobs that failed a re-verification (adapter_fabric.store.integrity), kept as evidence
    tmp/                          temp files, each flock'ed by its writer until renamed
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapter_fabric.store.files import encode_id


@dataclass(frozen=True)
class StoreLayout:
    """The paths of one store root."""

    root: Path

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def format_marker(self) -> Path:
        return self.root / "format"

    @property
    def blobs(self) -> Path:
        return self.root / "blobs" / "blake3"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def refs(self) -> Path:
        return self.root / "refs"

    @property
    def partials(self) -> Path:
        return self.root / "partial"

    @property
    def uploads(self) -> Path:
        return self.root / "uploads"

    @property
    def views(self) -> Path:
        return self.root / "views"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def signatures(self) -> Path:
        return self.root / "signatures"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def directories(self) -> tuple[Path, ...]:
        """Every directory the store needs, in creation order."""
        return (self.blobs, self.manifests, self.refs, self.partials, self.uploads, self.views, self.tmp, self.signatures, self.quarantine)

    def create(self) -> None:
        for directory in self.directories():
            directory.mkdir(parents=True, exist_ok=True)

    def blob(self, root: str) -> Path:
        """A committed file, by its root (adapter_fabric.store.digests)."""
        return self.blobs / root[:2] / root

    def manifest(self, digest: str) -> Path:
        return self.manifests / f"{digest}.json"

    def ref(self, adapter_id: str) -> Path:
        return self.refs / encode_id(adapter_id)

    def signature(self, digest: str) -> Path:
        return self.signatures / digest
