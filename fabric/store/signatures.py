"""Signatures kept beside manifests, one per signer: ``signers/<digest>/<public key hex>`` holds that signer's signature.

Each is verified under its signer's public key over its digest before it is
kept (``BadSignature`` otherwise, and nothing changes), so a relay passes on
what every author signed, and nobody who may stage can replace or remove a
valid one: a signer's file is written once, and goes only with its digest
(garbage collection) or with the last id that brought it.

A digest keeps at most ``MAX_SIGNERS`` places, and they cannot be squatted
(issue 28): ``signers/<digest>/owners.json`` records, per signer, the
principal that took its place and the ids whose Stage or pull brought it (at
most ``MAX_IDS_PER_SIGNER``). A place counts only while one of those ids still
names the digest (an unstage, a restage elsewhere or an eviction releases it;
the file goes at the next change); one principal takes at most
``MAX_SIGNERS_PER_PRINCIPAL`` places of a digest (a principal that may publish
everywhere, an operator, is not bounded); and a signer the node trusts always
gets a place, the place of another signer's untrusted signature if need be.
A signature kept before owners were recorded has no owner: it is kept, and
counted, as before.

A store written before signers were recorded holds one file,
``signatures/<digest>``, whose signer is not known: it is still read (as a
``Signed`` with no key, which only a node trusting signers can attribute) and
never written again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.errors import TooManySigners
from adapter_fabric.store.durable import TempFiles, fsync_dir
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.store_lock import StoreLock
from adapter_fabric.trust.signing import MAX_SIGNERS, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Signed, check_signed

__all__ = ["MAX_SIGNERS", "MAX_SIGNERS_PER_PRINCIPAL", "Signatures"]  # a Stage naming one more signer is refused (TooManySigners)

#: the places of one digest a single principal may take (a key rotation fits; a fistful of throwaway keys does not)
MAX_SIGNERS_PER_PRINCIPAL = 2
#: the ids recorded per signer as having brought its signature (more ids holding the digest keep it too, unrecorded)
MAX_IDS_PER_SIGNER = 16
OWNERS = "owners.json"

#: ``adapter_id -> the digest it names here, or None``: whether an id that brought a signature still holds its digest
RefOf = Callable[[str], "str | None"]


class Signatures:
    """The signatures that travel with a digest's manifest (none = unsigned); collected with the digest."""

    def __init__(self, layout: StoreLayout, lock: StoreLock, temps: TempFiles, ref_of: RefOf | None = None) -> None:
        self.layout = layout
        self.lock = lock
        self.temps = temps
        self._ref_of = ref_of

    def get(self, digest: str) -> tuple[Signed, ...]:
        """Every signature kept for ``digest`` whose place holds: per signer (re-verified: a damaged file is left out), then an
        old-layout one."""
        validate_digest(digest)
        owners = self._owners(digest)
        found = [s for s in self._signers(digest) if s.verifies(digest) and self._holds(owners.get(s.signer), digest)]
        try:
            legacy = self.layout.signature(digest).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            legacy = b""
        if len(legacy) == SIGNATURE_BYTES and all(s.signature != legacy for s in found):
            found.append(Signed(b"", legacy))
        return tuple(found)

    def held_by(self, digest: str, principal: str) -> int:
        """The places of ``digest`` ``principal`` holds now."""
        validate_digest(digest)
        owners = self._owners(digest)
        return sum(1 for s in self._signers(digest) if owners.get(s.signer, {}).get("principal") == principal and self._holds(owners[s.signer], digest))

    def add(
        self, digest: str, signed: Signed, *, adapter_id: str = "", principal: str | None = None, trusted: Callable[[Signed], bool] | None = None
    ) -> bool:
        """Keep ``signed`` for ``digest`` once verified (``BadSignature`` otherwise); True when it was not kept before.

        ``adapter_id``: the id whose Stage or pull brings it (the place is released with the last such id; "" records none).
        ``principal``: who brings it, bounded to ``MAX_SIGNERS_PER_PRINCIPAL`` places (None: not bounded). ``trusted``: which
        signatures this node trusts: one of those always gets a place, another signer's untrusted one giving way.
        ``TooManySigners`` (nothing changed) when the digest's places, or the principal's, are taken.
        """
        validate_digest(digest)
        check_signed(digest, signed, f"the signature of {digest[:12]}")
        is_trusted = trusted or (lambda s: False)
        folder = self.layout.signed_by(digest)
        with self.lock.held():
            owners = self._owners(digest)
            places = [s for s in self._signers(digest) if s.verifies(digest)]
            gone = [s for s in places if not self._holds(owners.get(s.signer), digest)]
            places = [s for s in places if s not in gone]
            mine = next((s for s in places if s.public_key == signed.public_key), None)
            if mine is not None:  # Ed25519 is deterministic: the one a signer made is the one kept; one more id brought it
                self._note_id(owners, mine.signer, adapter_id, digest)
                self._release(folder, owners, gone)
                return False
            if principal is not None and not is_trusted(signed):
                taken = sum(1 for s in places if owners.get(s.signer, {}).get("principal") == principal)
                if taken >= MAX_SIGNERS_PER_PRINCIPAL:
                    raise TooManySigners(
                        f"principal {principal!r} holds {taken} of digest {digest[:12]}'s signer places already, the most one principal "
                        f"takes ({MAX_SIGNERS_PER_PRINCIPAL}); nothing was kept"
                    )
            if len(places) >= MAX_SIGNERS:
                victim = self._victim(places, owners, is_trusted) if is_trusted(signed) else None
                if victim is None:
                    raise TooManySigners(f"digest {digest[:12]} already carries {len(places)} signers' signatures, the most a store keeps ({MAX_SIGNERS})")
                gone.append(victim)  # a trusted signer's signature is never refused for want of room
            if not folder.is_dir():
                folder.mkdir()
                fsync_dir(folder.parent)
            self.temps.write_atomic(folder / signed.signer, signed.signature)  # replaces a damaged file of the same signer
            owners[signed.signer] = {"principal": principal or "", "ids": [adapter_id] if adapter_id else []}
            self._release(folder, owners, gone, write=True)
        return True

    # ------------------------------------------------------------ places (under the store's lock when changed)

    def _holds(self, owner: dict | None, digest: str) -> bool:
        """Whether a signature's place holds: no owner recorded (kept as before), or one of the ids that brought it names ``digest``."""
        if owner is None or self._ref_of is None or not owner.get("ids"):
            return True
        return any(self._ref_of(i) == digest for i in owner["ids"])

    def _note_id(self, owners: dict, signer: str, adapter_id: str, digest: str) -> None:
        """Record that ``adapter_id`` brought ``signer``'s signature (the ids that left ``digest`` make room), and write it down."""
        entry = owners.get(signer)
        if entry is None or not adapter_id or adapter_id in entry["ids"]:
            return
        entry["ids"] = [i for i in entry["ids"] if self._ref_of is None or self._ref_of(i) == digest][: MAX_IDS_PER_SIGNER - 1] + [adapter_id]
        self._write_owners(self.layout.signed_by(digest), owners)

    def _victim(self, places: list[Signed], owners: dict, is_trusted: Callable[[Signed], bool]) -> Signed | None:
        """The untrusted signature that gives its place to a trusted one: its principal's most recent, of the principal holding most."""
        untrusted = [s for s in places if not is_trusted(s) and s.public_key]
        if not untrusted:
            return None
        counts: dict[str, int] = {}
        for s in untrusted:
            who = owners.get(s.signer, {}).get("principal", "")
            counts[who] = counts.get(who, 0) + 1
        return max(untrusted, key=lambda s: (counts[owners.get(s.signer, {}).get("principal", "")], s.signer))

    def _release(self, folder: Path, owners: dict, gone: list[Signed], write: bool = False) -> None:
        """Remove the signatures whose place was released (their ids left, or a trusted signer took it); write the owners."""
        for s in gone:
            (folder / s.signer).unlink(missing_ok=True)
            owners.pop(s.signer, None)
        if gone or write:
            self._write_owners(folder, owners)

    def _owners(self, digest: str) -> dict:
        try:
            raw = json.loads((self.layout.signed_by(digest) / OWNERS).read_bytes())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in raw.items() if isinstance(v, dict) and isinstance(v.get("ids"), list)} if isinstance(raw, dict) else {}

    def _write_owners(self, folder: Path, owners: dict) -> None:
        if folder.is_dir():
            self.temps.write_atomic(folder / OWNERS, json.dumps(owners, sort_keys=True).encode())

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
