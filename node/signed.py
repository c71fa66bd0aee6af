"""Signed adapters: the checks a node with --trusted-signers makes, and signatures carried along.

What is signed is the adapter's manifest digest (fabric/trust/signing.py).
Every check runs before a byte of the adapter moves: a Stage's StageBegin
declares the files' digests, so the digest is known before any data; a pull
reads the peer's manifest (with its signature) before fetching a chunk.
Signatures are kept by every node, trusting or not, so they travel with the
adapter.
"""

from __future__ import annotations

from typing import Callable

from adapter_fabric.store import AdapterStore
from adapter_fabric.store.digests import CONFIG_FILE, adapter_digest, check_scheme, hash_bytes
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport.pull import ManifestCheck, PeerPuller, PullStats, SinkFor
from adapter_fabric.trust.signing import TrustedSigners
from adapter_fabric.v1 import fabric_pb2


class SignedAdapters:
    """Trust checks for Stage, pulls, promotes and serving; owns the signatures of the pulls running now."""

    def __init__(self, store: AdapterStore, puller: PeerPuller, trusted: TrustedSigners) -> None:
        self.store = store
        self.puller = puller
        #: the signers whose adapters alone this node stages, pulls, loads and serves (none = any adapter)
        self.trusted = trusted
        # digest -> signature, while its pull runs: its verified chunks are served on meanwhile (check_stored)
        self._pulling_signatures: dict[str, bytes] = {}

    def check_stage_begin(self, begin: fabric_pb2.StageBegin) -> str:
        """The digest the staged files will have (from the declared weights root); refused unless trusted-signed.

        A client of another digest scheme is refused by name first (``IncompatibleFormat``).
        """
        check_scheme(begin.digest_scheme, f"the Stage of {begin.adapter_id[:200]!r}")
        validate_digest(begin.safetensors_blake3, "StageBegin.safetensors_blake3")
        validate_digest(begin.weights_root, f"StageBegin.weights_root (at this node's chunk size, {self.store.chunk_size})")
        digest = adapter_digest(hash_bytes(CONFIG_FILE, begin.config_json, self.store.chunk_size).root, begin.weights_root)
        self.trusted.check(digest, begin.signature, f"adapter {begin.adapter_id!r}")
        return digest

    def check_stored(self, manifest: Manifest) -> None:
        """An adapter this node holds (or is pulling) may be loaded or served only if a trusted signer signed its digest."""
        if self.trusted.required:
            signature = self.store.signature(manifest.digest) or self._pulling_signatures.get(manifest.digest, b"")
            self.trusted.check(manifest.digest, signature, f"adapter {manifest.adapter_id!r}")

    def pull(
        self, peers: list[str], adapter_id: str, check: Callable[[Manifest], None] | None = None, sink_for: SinkFor | None = None
    ) -> tuple[Manifest, PullStats]:
        """``puller.pull`` with the trust check of the manifest's signature, the signature kept once the pull commits.

        Blocking (run it on an I/O thread): the keeping in ``finally`` then runs whatever happens to the caller.
        """
        seen: list[str] = []
        committed = False
        try:
            result = self.puller.pull(peers, adapter_id, self._signed_pull_check(adapter_id, check, seen), sink_for)
            committed = True
            return result
        finally:
            if seen:
                self._keep_pulled_signature(seen[0], committed)

    def _signed_pull_check(self, adapter_id: str, check: Callable[[Manifest], None] | None, seen: list[str]) -> ManifestCheck:
        """A pull's manifest check (``adapter_fabric.transport.pull.ManifestCheck``), preceded by the trust check of its signature.

        The signature comes with the manifest the pull itself reads (one GetManifest). It is held in memory
        while the pull runs (its verified chunks are served on meanwhile) and kept in the store once the pull
        commits (``_keep_pulled_signature``); a failed pull leaves none. ``seen`` gets the digest checked.
        """

        def signed_check(manifest: Manifest, signature: bytes) -> None:
            if self.trusted.required:
                self.trusted.check(manifest.digest, signature, f"adapter {adapter_id!r}")
            seen.append(manifest.digest)
            if signature:
                self._pulling_signatures[manifest.digest] = signature
            if check is not None:
                check(manifest)

        return signed_check

    def _keep_pulled_signature(self, digest: str, committed: bool) -> None:
        signature = self._pulling_signatures.pop(digest, b"") if digest else b""
        if committed and signature:
            self.store.set_signature(digest, signature)  # it travels on from here
