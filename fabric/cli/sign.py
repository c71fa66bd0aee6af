"""``fabric keygen`` and ``fabric sign``: an author's key pair and the signature of an adapter's manifest digest.

What is signed is documented in ``adapter_fabric.trust.signing``. ``fabric stage
--sign-key KEY`` signs while staging.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from adapter_fabric.cli.output import emit
from adapter_fabric.units import parse_chunk_size

DEFAULT_CHUNK_SIZE = 1 << 20  # adapter_fabric.store.digests.DEFAULT_CHUNK_SIZE (not imported: the CLI starts without the store)


def chunk_size(text: str) -> int:
    """``--chunk-size``: the node flag's units and bounds (4KiB to 4MiB, adapter_fabric.units)."""
    try:
        return parse_chunk_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (fabric-node --chunk-size's bounds)") from None


def cmd_keygen(args: argparse.Namespace) -> None:
    """Write ``OUT.key`` (private, PEM, mode 0600) and ``OUT.pub`` (public, PEM: give it to nodes' --trusted-signers)."""
    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.trust.signing import keygen

    key_path, pub_path = Path(f"{args.out}.key"), Path(f"{args.out}.pub")
    for path in (key_path, pub_path):
        if path.exists():  # an error like any other, so --json reports it as JSON (exit 1)
            raise InvalidArgument(f"{path} exists: not overwriting a key (give another name, or move the old pair away first)")
    private, public = keygen()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub_path.write_bytes(public)
    emit(args.json, {"private_key": str(key_path), "public_key": str(pub_path)}, f"wrote {key_path} (keep it secret) and {pub_path} (for --trusted-signers)")


def cmd_sign(args: argparse.Namespace) -> None:
    """Print the digest of a PEFT directory and its signature (hex) by ``--key``."""
    from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, build_manifest
    from adapter_fabric.trust.signing import sign_digest

    directory = Path(args.dir)
    manifest = build_manifest("signing", (directory / CONFIG_FILE).read_bytes(), directory / WEIGHTS_FILE, args.chunk_size)
    signature = sign_digest(Path(args.key).read_bytes(), manifest.digest)
    emit(args.json, {"digest": manifest.digest, "signature": signature.hex()}, f"digest={manifest.digest} signature={signature.hex()}")


def register(command) -> None:
    """Add ``keygen`` and ``sign`` through ``command(name, handler, help, node=False)`` (see ``adapter_fabric.cli.main``)."""
    p = command("keygen", cmd_keygen, "make an Ed25519 key pair for signing adapters (OUT.key, OUT.pub)", node=False)
    p.add_argument("out", help="path prefix: writes OUT.key and OUT.pub")
    p = command("sign", cmd_sign, "print an adapter directory's digest and its signature by --key", node=False)
    p.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--key", required=True, help="private key (PEM, as fabric keygen writes it)")
    p.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK_SIZE,
                   help="the chunk size of the nodes that will stage it (part of the digest; default 1 MiB, as fabric-node's)")
