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
    signers/<digest>/<key hex>    one Ed25519 signature of a digest per signer, named by its raw public key (adapter_fabric.store.signatures)
    signers/<digest>/owners.json  per signer: the principal that took its place and the ids that brought it
    signatures/<digest>           a signature kept before signers were recorded (read, never written now)
    quarantine/<root>-<ns>        blobs that failed a re-verification (adapter_fabric.store.integrity), kept as evidence
    tmp/                          temp files, each flock'ed by its writer until renamed
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from adapter_fabric.store.files import encode_id


@dataclass(frozen=True)
class StoreLayout:
    """The paths of one store root (each directory's path built once: listings ask for them per entry)."""

    root: Path

    @cached_property
    def lock(self) -> Path:
        return self.root / "lock"

    @cached_property
    def format_marker(self) -> Path:
        return self.root / "format"

    @cached_property
    def blobs(self) -> Path:
        return self.root / "blobs" / "blake3"

    @cached_property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @cached_property
    def refs(self) -> Path:
        return self.root / "refs"

    @cached_property
    def partials(self) -> Path:
        return self.root / "partial"

    @cached_property
    def uploads(self) -> Path:
        return self.root / "uploads"

    @cached_property
    def views(self) -> Path:
        return self.root / "views"

    @cached_property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @cached_property
    def signatures(self) -> Path:
        return self.root / "signatures"

    @cached_property
    def signers(self) -> Path:
        return self.root / "signers"

    @cached_property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def directories(self) -> tuple[Path, ...]:
        """Every directory the store needs, in creation order."""
        return (self.blobs, self.manifests, self.refs, self.partials, self.uploads, self.views, self.tmp, self.signatures, self.signers, self.quarantine)

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
        """A signature kept before signers were recorded (the old layout)."""
        return self.signatures / digest

    def signed_by(self, digest: str) -> Path:
        """The directory of a digest's signatures, one file per signer."""
        return self.signers / digest
