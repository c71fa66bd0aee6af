"""``fabric keygen`` and ``fabric sign``: an author's key pair and the signature of an adapter's manifest digest.

Self-contained command functions (the CLI's parser adds them); what is signed
is documented in ``fabric.trust.signing``. ``fabric stage --sign-key KEY``
signs while staging.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def cmd_keygen(args: argparse.Namespace) -> None:
    """Write ``OUT.key`` (private, PEM, mode 0600) and ``OUT.pub`` (public, PEM: give it to nodes' --trusted-signers)."""
    from fabric.trust.signing import keygen

    private, public = keygen()
    key_path, pub_path = Path(f"{args.out}.key"), Path(f"{args.out}.pub")
    for path in (key_path, pub_path):
        if path.exists():
            raise SystemExit(f"fabric keygen: {path} exists; not overwriting a key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub_path.write_bytes(public)
    print(f"wrote {key_path} (keep it secret) and {pub_path} (for --trusted-signers)")


def cmd_sign(args: argparse.Namespace) -> None:
    """Print the digest of a PEFT directory and its signature (hex) by ``--key``."""
    from fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, build_manifest
    from fabric.trust.signing import sign_digest

    directory = Path(args.dir)
    manifest = build_manifest("signing", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE)
    signature = sign_digest(Path(args.key).read_bytes(), manifest.digest)
    if args.json:
        print(json.dumps({"digest": manifest.digest, "signature": signature.hex()}))
    else:
        print(f"digest={manifest.digest} signature={signature.hex()}")


def add_sign_commands(sub) -> None:
    """Add ``keygen`` and ``sign`` to the CLI's subparsers."""
    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signing adapters", description=cmd_keygen.__doc__)
    p.add_argument("out", help="path prefix: writes OUT.key and OUT.pub")
    p.set_defaults(handler=cmd_keygen)
    p = sub.add_parser("sign", help="print an adapter directory's digest and its signature", description=cmd_sign.__doc__)
    p.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--key", required=True, help="private key (PEM, as fabric keygen writes it)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_sign)
