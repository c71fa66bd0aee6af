"""Signed adapters in the servicer: the checks a node with --trusted-signers makes, and signatures carried along.

A mixin of ``FabricServicer`` (uses its store, puller and ``trusted``). What
is signed is the adapter's manifest digest (fabric/trust/signing.py). Every
check runs before a byte of the adapter moves: a Stage's StageBegin declares
the files' digests, so the digest is known before any data; a pull reads the
peer's manifest (with its signature) before fetching a chunk. Signatures are
kept by every node, trusting or not, so they travel with the adapter.
"""

from __future__ import annotations

import grpc

from fabric.errors import Untrusted
from fabric.store.digests import CONFIG_FILE, adapter_digest, hash_bytes
from fabric.store.ids import validate_digest
from fabric.store.manifest import Manifest
from fabric.v1 import fabric_pb2, fabric_pb2_grpc

SIGNATURE_LOOKUP_TIMEOUT_S = 30.0


class SignedAdapters:
    """Trust checks for Stage, pulls, promotes and serving, mixed into ``FabricServicer``."""

    def _check_stage_begin(self, begin: fabric_pb2.StageBegin) -> str:
        """The digest the staged files will have (from the declared weights digest); refused unless trusted-signed."""
        validate_digest(begin.safetensors_sha256, "safetensors sha256")
        digest = adapter_digest(hash_bytes(CONFIG_FILE, begin.config_json, self.store.chunk_size).sha256, begin.safetensors_sha256)
        self.trusted.check(digest, begin.signature, f"adapter {begin.adapter_id!r}")
        return digest

    def _check_stored(self, manifest: Manifest) -> None:
        """An adapter this node holds (or is pulling) may be loaded or served only if a trusted signer signed its digest."""
        if self.trusted.required:
            signature = self.store.signature(manifest.digest) or self._pulling_signatures.get(manifest.digest, b"")
            self.trusted.check(manifest.digest, signature, f"adapter {manifest.adapter_id!r}")

    def _peer_signature(self, peers: list[str], adapter_id: str) -> tuple[str, bytes]:
        """``(digest, signature)`` of ``adapter_id`` from the first peer whose manifest answers; ``("", b"")`` if none does."""
        for peer in peers:
            stub = fabric_pb2_grpc.FabricStub(self.puller.channels.get(peer))
            try:
                reply = stub.GetManifest(fabric_pb2.GetManifestRequest(adapter_id=adapter_id), timeout=SIGNATURE_LOOKUP_TIMEOUT_S)
            except grpc.RpcError:
                continue
            return reply.digest, bytes(reply.signature)
        return "", b""

    def _signed_pull_check(self, peers: list[str], adapter_id: str, check):
        """A pull's manifest check, preceded by the trust check of the signed digest.

        The signature is held in memory while the pull runs (its verified chunks are served on meanwhile)
        and kept in the store once the pull commits (``_keep_pulled_signature``); a failed pull leaves none.
        """
        digest, signature = self._peer_signature(peers, adapter_id)
        if self.trusted.required and digest:
            self.trusted.check(digest, signature, f"adapter {adapter_id!r} on {peers[0]}")

        def signed_check(manifest: Manifest) -> None:
            if self.trusted.required and manifest.digest != digest:
                raise Untrusted(f"adapter {adapter_id!r}: the manifest pulled ({manifest.digest}) is not the one whose signature was checked ({digest or 'none'})")
            if signature and manifest.digest == digest:
                self._pulling_signatures[digest] = signature
            if check is not None:
                check(manifest)

        return signed_check, digest

    def _keep_pulled_signature(self, digest: str, committed: bool) -> None:
        signature = self._pulling_signatures.pop(digest, b"") if digest else b""
        if committed and signature:
            self.store.set_signature(digest, signature)  # it travels on from here
