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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from adapter_fabric.errors import InvalidArgument, Untrusted

SIGNATURE_DOMAIN = b"adapter-fabric manifest signature v1\0"
SIGNATURE_BYTES = 64


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
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"not an Ed25519 private key (PEM PKCS#8 or 32 raw bytes): {exc}") from None
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
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"not an Ed25519 public key (PEM or 32 raw bytes): {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidArgument(f"the public key is {type(key).__name__}, not Ed25519")
    return key


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

    @classmethod
    def from_files(cls, paths: Iterable[Path | str]) -> "TrustedSigners":
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

    def check(self, digest: str, signature: bytes, what: str) -> None:
        """Refuse (``Untrusted``) unless ``signature`` is a trusted signer's over ``digest``; a no-op when none are configured."""
        if not self.keys:
            return
        from cryptography.exceptions import InvalidSignature

        if not signature:
            raise Untrusted(f"{what} is not signed, and this node serves only adapters signed by its trusted signers (--trusted-signers)")
        message = _message(digest)
        for key in self.keys:
            try:
                key.verify(bytes(signature), message)
                return
            except InvalidSignature:
                continue
        raise Untrusted(f"{what}: its signature is not by a trusted signer (or the manifest was changed after it was signed); nothing was moved")
