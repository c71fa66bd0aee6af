"""Signatures kept beside manifests, one per signer: ``signers/<digest>/<public key hex>`` holds that signer's signature.

Each is verified under its signer's public key over its digest before it is
kept (``BadSignature`` otherwise, and nothing changes), so a relay passes on
what every author signed, and nobody who may stage can replace or remove a
valid one: a signer's file is written once, and goes only with its digest
(garbage collection). A digest keeps at most ``MAX_SIGNERS``.

A store written before signers were recorded holds one file,
``signatures/<digest>``, whose signer is not known: it is still read (as a
``Signed`` with no key, which only a node trusting signers can attribute) and
never written again.
"""

from __future__ import annotations

import os

from adapter_fabric.errors import TooManySigners
from adapter_fabric.store.durable import TempFiles, fsync_dir
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.store_lock import StoreLock
from adapter_fabric.trust.signing import MAX_SIGNERS, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Signed, check_signed

__all__ = ["MAX_SIGNERS", "Signatures"]  # MAX_SIGNERS: a Stage naming one more signer is refused (TooManySigners), a pull keeps the first


class Signatures:
    """The signatures that travel with a digest's manifest (none = unsigned); collected with the digest."""

    def __init__(self, layout: StoreLayout, lock: StoreLock, temps: TempFiles) -> None:
        self.layout = layout
        self.lock = lock
        self.temps = temps

    def get(self, digest: str) -> tuple[Signed, ...]:
        """Every signature kept for ``digest``: per signer (re-verified: a damaged file is left out), then an old-layout one."""
        validate_digest(digest)
        found = [s for s in self._signers(digest) if s.verifies(digest)]
        try:
            legacy = self.layout.signature(digest).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            legacy = b""
        if len(legacy) == SIGNATURE_BYTES and all(s.signature != legacy for s in found):
            found.append(Signed(b"", legacy))
        return tuple(found)

    def add(self, digest: str, signed: Signed) -> bool:
        """Keep ``signed`` for ``digest`` once verified (``BadSignature`` otherwise); True when it was not kept before.

        ``TooManySigners`` when the digest already has ``MAX_SIGNERS`` other signers.
        """
        validate_digest(digest)
        check_signed(digest, signed, f"the signature of {digest[:12]}")
        folder = self.layout.signed_by(digest)
        with self.lock.held():
            held = [s for s in self._signers(digest) if s.verifies(digest)]
            if any(s.public_key == signed.public_key for s in held):
                return False  # Ed25519 is deterministic: the one a signer made is the one kept
            if len(held) >= MAX_SIGNERS:
                raise TooManySigners(f"digest {digest[:12]} already carries {len(held)} signers' signatures, the most a store keeps ({MAX_SIGNERS})")
            if not folder.is_dir():
                folder.mkdir()
                fsync_dir(folder.parent)
            self.temps.write_atomic(folder / signed.signer, signed.signature)  # replaces a damaged file of the same signer
        return True

    def _signers(self, digest: str) -> list[Signed]:
        """The per-signer files of ``digest`` as they are on disk, sorted by signer (unverified)."""
        try:
            entries = sorted(os.scandir(self.layout.signed_by(digest)), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries[: MAX_SIGNERS * 2]:  # bounded even if files were added by hand
            try:
                key = bytes.fromhex(entry.name)
                with open(entry.path, "rb") as f:
                    data = f.read(SIGNATURE_BYTES + 1)
            except (ValueError, OSError):
                continue
            if len(key) == PUBLIC_KEY_BYTES:
                found.append(Signed(key, data))
        return found
