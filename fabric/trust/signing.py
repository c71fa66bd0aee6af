"""Ed25519 signatures over adapter manifests, and the set of signers a node trusts.

What is signed, exactly: the 64 bytes of ::

    ed25519_sign(key, b"adapter-fabric manifest signature v1\\0" + digest)

with ``digest`` the adapter's manifest digest as 64 lowercase ASCII hex
characters. The digest names the adapter's content (its config and weights
files, through their digests; adapter_fabric.store.manifest), so a signature vouches
for those bytes under any id: ids are references a stager chooses, and the
same signed content may be staged under several. The domain prefix keeps a
signature from meaning anything else. Any change of digest scheme changes
the digest, so a signature made under one scheme never verifies under another.

Keys: a private key is a PEM PKCS#8 file, or 32 raw bytes; a public key a PEM
SubjectPublicKeyInfo file, or 32 raw bytes (as ``keygen`` writes them).

A signature travels with its signer's public key (``Signed``; on the wire a
``SignerSignature``), so any node can check it before keeping it, trusting
signers or not. A ``Signed`` with no key is one kept before signers were
recorded: only a node that trusts signers can tell whose it is (``attribute``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adapter_fabric.errors import BadSignature, InvalidArgument, Untrusted

SIGNATURE_DOMAIN = b"adapter-fabric manifest signature v1\0"
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
#: the most signers' signatures a store keeps per digest, and a node reads from a peer's manifest
MAX_SIGNERS = 16


def _message(digest: str) -> bytes:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise InvalidArgument(f"digest {digest[:80]!r} is not 64 lowercase hex characters")
    return SIGNATURE_DOMAIN + digest.encode("ascii")


def load_private_key(data: bytes):
    """An Ed25519 private key from PEM (PKCS#8) or 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):  # cryptography's reason names PEM framing internals, not what to give
        raise InvalidArgument("not an Ed25519 private key (PEM PKCS#8 or 32 raw bytes, as fabric keygen writes NAME.key)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidArgument(f"the private key is {type(key).__name__}, not Ed25519")
    return key


def load_public_key(data: bytes):
    """An Ed25519 public key from PEM (SubjectPublicKeyInfo) or 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise InvalidArgument("not an Ed25519 public key (PEM or 32 raw bytes, as fabric keygen writes NAME.pub)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidArgument(f"the public key is {type(key).__name__}, not Ed25519")
    return key


def raw_public_key(key) -> bytes:
    """The 32 raw bytes of an Ed25519 public key object (what travels and names a signer)."""
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Signed:
    """One signature of a digest and its signer's raw public key (b"" = a signature whose signer is not recorded)."""

    public_key: bytes
    signature: bytes

    @property
    def signer(self) -> str:
        """The signer's id: its raw public key in hex ("" when unknown)."""
        return self.public_key.hex()

    def verifies(self, digest: str) -> bool:
        """Whether this is its signer's signature over ``digest`` (False for a signature with no key)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if len(self.public_key) != PUBLIC_KEY_BYTES or len(self.signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(self.signature, _message(digest))
        except (InvalidSignature, ValueError):
            return False
        return True


def signatures_from_proto(reply) -> tuple[Signed, ...]:
    """The signatures a ``fabric.v1.Manifest`` carries (at most ``MAX_SIGNERS``; a bare ``signature`` not among them has no key)."""
    found = [Signed(bytes(s.public_key), bytes(s.signature)) for s in reply.signatures[:MAX_SIGNERS]]
    if reply.signature and all(s.signature != reply.signature for s in found) and len(found) < MAX_SIGNERS:
        found.append(Signed(b"", bytes(reply.signature)))
    return tuple(found)


def signatures_to_proto(reply, signatures: Sequence[Signed]) -> None:
    """Put ``signatures`` on a ``fabric.v1.Manifest``: each with its key, and the first bare, for a reader of ``signature`` alone."""
    for signed in signatures:
        if signed.public_key:
            reply.signatures.add(public_key=signed.public_key, signature=signed.signature)
    if signatures:
        reply.signature = signatures[0].signature


def check_signed(digest: str, signed: Signed, what: str) -> None:
    """Refuse (``BadSignature``, naming ``what``) a signature that is not its named signer's over ``digest``."""
    if len(signed.public_key) != PUBLIC_KEY_BYTES:
        raise BadSignature(f"{what}: the signer's public key is {len(signed.public_key)} bytes, not {PUBLIC_KEY_BYTES} raw Ed25519 bytes; nothing was kept")
    if len(signed.signature) != SIGNATURE_BYTES:
        raise BadSignature(f"{what}: the signature is {len(signed.signature)} bytes, not {SIGNATURE_BYTES}; nothing was kept")
    if not signed.verifies(digest):
        raise BadSignature(f"{what}: the signature is not signer {signed.signer[:16]}'s over digest {digest[:12]} (other bytes, or damaged); nothing was kept")


def sign(private_key: bytes, digest: str) -> Signed:
    """``sign_digest`` with the signer's public key beside it."""
    key = load_private_key(private_key)
    return Signed(raw_public_key(key.public_key()), key.sign(_message(digest)))


def keygen() -> tuple[bytes, bytes]:
    """A new key pair as ``(private PEM, public PEM)``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def sign_digest(private_key: bytes, digest: str) -> bytes:
    """The 64-byte signature of an adapter's manifest digest (see the module docstring for what is signed)."""
    return load_private_key(private_key).sign(_message(digest))


@dataclass(frozen=True)
class TrustedSigners:
    """The public keys a node trusts; empty = trust is not required (every adapter is accepted, signed or not)."""

    keys: tuple = ()
    #: digests the node takes unsigned all the same: content an origin marked #trusted gave (adapter_fabric.origins)
    vouched: set = field(default_factory=set, compare=False)

    def vouch(self, digest: str) -> None:
        """Take ``digest`` unsigned from now on (the operator vouched for the origin it came from)."""
        self.vouched.add(digest)

    @classmethod
    def from_files(cls, paths: Iterable[Path | str]) -> TrustedSigners:
        keys = []
        for path in paths:
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgument(f"trusted signer {path}: {exc.strerror}") from None
            try:
                keys.append(load_public_key(data))
            except InvalidArgument as exc:
                raise InvalidArgument(f"trusted signer {path}: {exc}") from None
        return cls(tuple(keys))

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def attribute(self, digest: str, signed: Signed) -> Signed | None:
        """``signed`` with its signer's key: the trusted key it verifies under (a keyless one), or itself if it verifies; else None."""
        if signed.public_key:
            return signed if signed.verifies(digest) else None
        for key in self.keys:
            candidate = Signed(raw_public_key(key), signed.signature)
            if candidate.verifies(digest):
                return candidate
        return None

    def trusts(self, digest: str, signatures: Sequence[Signed]) -> bool:
        """Whether ``check`` passes (always, when no signers are configured)."""
        try:
            self.check(digest, signatures, "")
        except Untrusted:
            return False
        return True

    def check(self, digest: str, signatures: Sequence[Signed], what: str) -> None:
        """Refuse (``Untrusted``) unless one of ``signatures`` is a trusted signer's over ``digest``; a no-op when none are configured."""
        if not self.keys or digest in self.vouched:
            return
        if not signatures:
            raise Untrusted(f"{what} is not signed, and this node serves only adapters signed by its trusted signers (--trusted-signers)")
        trusted = {raw_public_key(key) for key in self.keys}
        for signed in signatures:
            found = self.attribute(digest, signed)
            if found is not None and found.public_key in trusted:
                return
        raise Untrusted(f"{what}: no signature by a trusted signer (or the manifest was changed after it was signed); nothing was moved")
