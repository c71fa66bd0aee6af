"""Signatures kept beside manifests: ``signatures/<digest>`` holds the author's signature of that digest (adapter_fabric.trust)."""

from __future__ import annotations

from adapter_fabric.store.committer import Committer
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.trust.signing import SIGNATURE_BYTES  # anything of another size is not kept


class Signatures:
    """The signature that travels with a digest's manifest (empty = unsigned); collected with the digest."""

    def __init__(self, layout: StoreLayout, committer: Committer) -> None:
        self.layout = layout
        self.committer = committer

    def get(self, digest: str) -> bytes:
        """The signature kept for ``digest``; b"" when none."""
        validate_digest(digest)
        try:
            data = self.layout.signature(digest).read_bytes()
        except FileNotFoundError:
            return b""
        return data if len(data) == SIGNATURE_BYTES else b""

    def set(self, digest: str, signature: bytes) -> None:
        """Keep ``signature`` for ``digest`` (it is checked by whoever trusts signers, not here); b"" keeps what is there."""
        validate_digest(digest)
        if len(signature) != SIGNATURE_BYTES or self.get(digest) == signature:
            return
        self.committer.write_metadata(self.layout.signature(digest), bytes(signature))
