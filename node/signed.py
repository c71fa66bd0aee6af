"""Signed adapters: the checks a node with --trusted-signers makes, and signatures carried along.

What is signed is the adapter's manifest digest (fabric/trust/signing.py).
Every check runs before a byte of the adapter moves: a Stage's StageBegin
declares the files' digests, so the digest is known before any data; a pull
reads the peer's manifest (with its signatures) before fetching a chunk.
Signatures are kept by every node, trusting or not, each once it verifies under
its signer's public key (``adapter_fabric.store.signatures``), so every author's
travels with the adapter and none can be replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from adapter_fabric.access.policy import CLUSTER, Principal
from adapter_fabric.errors import BadSignature, TooManySigners
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.digests import CONFIG_FILE, adapter_digest, check_scheme, hash_bytes
from adapter_fabric.store.ids import validate_digest
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.signatures import MAX_SIGNERS_PER_PRINCIPAL
from adapter_fabric.transport.pull import ManifestCheck, PeerPuller, PullStats, SinkFor
from adapter_fabric.trust.signing import MAX_SIGNERS, Signed, TrustedSigners, check_signed
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.node")


class SignedAdapters:
    """Trust checks for Stage, pulls, promotes and serving; owns the signatures of the pulls running now."""

    def __init__(self, store: AdapterStore, puller: PeerPuller, trusted: TrustedSigners) -> None:
        self.store = store
        self.puller = puller
        #: the signers whose adapters alone this node stages, pulls, loads and serves (none = any adapter)
        self.trusted = trusted
        # digest -> verified signatures, while its pull runs: its verified chunks are served on meanwhile (check_stored)
        self._pulling_signatures: dict[str, tuple[Signed, ...]] = {}

    def check_stage_begin(self, begin: fabric_pb2.StageBegin, who: Principal = CLUSTER) -> tuple[str, Signed | None]:
        """The digest the staged files will have (from the declared weights root), and the signature to keep once they commit.

        Refused before any byte moves: a client of another digest scheme (``IncompatibleFormat``), a signature that is not
        its named signer's over that digest (``BadSignature``), a new untrusted signer past ``MAX_SIGNERS`` or past
        ``MAX_SIGNERS_PER_PRINCIPAL`` of ``who``'s (``TooManySigners``), and on a node that trusts signers an adapter none of
        them signed (``Untrusted``). Blocking (reads the store).
        """
        what = f"adapter {begin.adapter_id!r}"
        check_scheme(begin.digest_scheme, f"the Stage of {begin.adapter_id[:200]!r}")
        validate_digest(begin.safetensors_blake3, "StageBegin.safetensors_blake3")
        validate_digest(begin.weights_root, f"StageBegin.weights_root (at this node's chunk size, {self.store.chunk_size})")
        digest = adapter_digest(hash_bytes(CONFIG_FILE, begin.config_json, self.store.chunk_size).root, begin.weights_root)
        signed = Signed(bytes(begin.signer_public_key), bytes(begin.signature)) if begin.signature else None
        if signed is None and begin.signer_public_key:
            raise BadSignature(f"{what}: StageBegin.signer_public_key comes without a signature; nothing was kept")
        if signed is not None and not signed.public_key:
            # A client that names no key: a node that trusts signers finds it among its own, any other cannot check it.
            if not self.trusted.required:
                raise BadSignature(f"{what}: StageBegin.signature comes without StageBegin.signer_public_key, so it cannot be checked; nothing was kept")
            self.trusted.check(digest, (signed,), what)  # Untrusted unless one of this node's keys makes it
            signed = self.trusted.attribute(digest, signed)
        if signed is not None:
            check_signed(digest, signed, what)
            held = [s.public_key for s in self.store.signatures_of(digest) if s.public_key]
            if signed.public_key not in held and not self.is_trusted(digest, signed):  # a trusted signer always gets a place
                if len(held) >= MAX_SIGNERS:
                    raise TooManySigners(f"{what}: digest {digest[:12]} already carries {len(held)} signers' signatures, the most a store keeps ({MAX_SIGNERS})")
                bounded = place_taker(who)
                if bounded is not None and self.store.signer_places(digest, bounded) >= MAX_SIGNERS_PER_PRINCIPAL:
                    raise TooManySigners(
                        f"{what}: principal {bounded!r} holds {MAX_SIGNERS_PER_PRINCIPAL} of digest {digest[:12]}'s signer places already, "
                        f"the most one principal takes"
                    )
        self.trusted.check(digest, (signed,) if signed is not None else (), what)
        return digest, signed

    def keep_staged(self, digest: str, signed: Signed, adapter_id: str, who: Principal) -> None:
        """The signature a Stage of ``adapter_id`` by ``who`` carried, kept once its bytes committed (its place is ``who``'s,
        and goes with the last id that brought it). Blocking (reads and writes the store)."""
        self.store.add_signature(digest, signed, adapter_id=adapter_id, principal=place_taker(who), trusted=lambda s: self.is_trusted(digest, s))

    def is_trusted(self, digest: str, signed: Signed) -> bool:
        """Whether this node trusts signers and ``signed`` is one of theirs over ``digest`` (such a signature always gets a place)."""
        return self.trusted.required and self.trusted.trusts(digest, (signed,))

    def check_stored(self, manifest: Manifest) -> None:
        """An adapter this node holds (or is pulling) may be loaded or served only if a trusted signer signed its digest."""
        if self.trusted.required:
            signatures = self.store.signatures_of(manifest.digest) + self._pulling_signatures.get(manifest.digest, ())
            self.trusted.check(manifest.digest, signatures, f"adapter {manifest.adapter_id!r}")

    def pull(
        self, peers: list[str], adapter_id: str, check: Callable[[Manifest], None] | None = None, sink_for: SinkFor | None = None,
        who: Principal = CLUSTER, *, complete: Collection[str] = (), **authority,
    ) -> tuple[Manifest, PullStats]:
        """``puller.pull`` with the trust check of the manifest's signature, the signature kept once the pull commits.

        ``who``: the caller it runs for (its signatures are kept as ``keep_pulled`` says); ``authority``: the caller's
        (``PeerPuller.pull``'s ``behalf`` and ``may_reuse``; none: the node pulls as itself).
        Blocking (run it on an I/O thread): the keeping in ``finally`` then runs whatever happens to the caller.
        """
        seen: list[str] = []
        committed = False
        try:
            result = self.puller.pull(peers, adapter_id, self._signed_pull_check(adapter_id, check, seen), sink_for, complete=complete, **authority)
            committed = True
            return result
        finally:
            if seen:
                self._keep_pulled_signature(seen[0], committed, adapter_id, who)

    def _signed_pull_check(self, adapter_id: str, check: Callable[[Manifest], None] | None, seen: list[str]) -> ManifestCheck:
        """A pull's manifest check (``adapter_fabric.transport.pull.ManifestCheck``), preceded by the trust check of its signature.

        The signatures come with the manifest the pull itself reads (one GetManifest). Those that verify under
        their signer's key (a keyless one: under a trusted key) are held in memory while the pull runs (its
        verified chunks are served on meanwhile) and kept in the store once the pull commits
        (``_keep_pulled_signature``); the others are dropped, named in the log. A failed pull keeps none.
        ``seen`` gets the digest checked.
        """

        def signed_check(manifest: Manifest, signatures: tuple[Signed, ...]) -> None:
            if self.trusted.required:
                self.trusted.check(manifest.digest, signatures, f"adapter {adapter_id!r}")
            seen.append(manifest.digest)
            verified = tuple(v for v in (self.trusted.attribute(manifest.digest, s) for s in signatures) if v is not None)
            # This node's trusted signers first: if the digest's places run out here, theirs are the ones kept.
            verified = tuple(sorted(verified, key=lambda s: not self.trusted.trusts(manifest.digest, (s,))))
            if len(verified) < len(signatures):
                log.warning("pull of %r: %d of its %d signatures do not verify under their signer's key; not kept", adapter_id, len(signatures) - len(verified), len(signatures))
            if verified:
                self._pulling_signatures[manifest.digest] = verified
            if check is not None:
                check(manifest)

        return signed_check

    def _keep_pulled_signature(self, digest: str, committed: bool, adapter_id: str, who: Principal) -> None:
        """The verified signatures of a committed pull, kept: a trusted signer's always; another's only when ``who`` may publish
        ``adapter_id`` (a signer place is taken only by a principal with publish on an id holding the digest), within its places."""
        signatures = self._pulling_signatures.pop(digest, ()) if digest else ()
        if not committed:
            return
        publishes = who.allows("publish", adapter_id)
        for signed in signatures:  # they travel on from here
            if not publishes and not self.is_trusted(digest, signed):
                log.info("pulled signature of %s by %s not kept: principal %r may not publish %r", digest[:12], signed.signer[:12], who.name, adapter_id)
                continue
            try:
                self.store.add_signature(
                    digest, signed, adapter_id=adapter_id, principal=place_taker(who), trusted=lambda s: self.is_trusted(digest, s)
                )
            except (BadSignature, TooManySigners) as exc:
                log.warning("pulled signature of %s not kept: %s", digest[:12], exc)


def place_taker(who: Principal) -> str | None:
    """The principal a signer place is counted against (``MAX_SIGNERS_PER_PRINCIPAL``); None for one that may publish
    everywhere (an operator, the cluster token): not bounded."""
    return None if who.may_everywhere("publish") else who.name
