"""Signatures kept beside manifests: ``signatures/<digest>`` holds the author's signature of that digest (fabric.trust)."""

from __future__ import annotations

from fabric.store.ids import validate_digest

#: an Ed25519 signature's size; anything else is not kept
SIGNATURE_BYTES = 64


class StoreSignatures:
    """Mixed into ``AdapterStore``: the signature that travels with a digest's manifest (empty = unsigned)."""

    def signature(self, digest: str) -> bytes:
        """The signature kept for ``digest``; b"" when none."""
        validate_digest(digest)
        try:
            data = (self.signatures / digest).read_bytes()
        except FileNotFoundError:
            return b""
        return data if len(data) == SIGNATURE_BYTES else b""

    def set_signature(self, digest: str, signature: bytes) -> None:
        """Keep ``signature`` for ``digest`` (it is checked by whoever trusts signers, not here); b"" keeps what is there."""
        validate_digest(digest)
        if len(signature) != SIGNATURE_BYTES or self.signature(digest) == signature:
            return
        with self._locked():
            self._write_atomic(self.signatures / digest, bytes(signature))
