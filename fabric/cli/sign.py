"""``fabric keygen`` and ``fabric sign``: an author's key pair and the signature of an adapter's manifest digest.

What is signed is documented in ``adapter_fabric.trust.signing``. ``fabric stage
--sign-key KEY`` signs while staging; ``fabric sign DIR --key KEY --out FILE`` signs
where the key is (no node needed) and ``fabric stage ... --signature FILE`` attaches it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from adapter_fabric.cli.output import emit
from adapter_fabric.cli.paths import read_input, writable_parent
from adapter_fabric.units import parse_chunk_size

#: what to give instead of a --key (--sign-key) that cannot be read
KEY_FIX = "give the private key `fabric keygen NAME` wrote (NAME.key)"
DEFAULT_CHUNK_SIZE = 1 << 20  # adapter_fabric.store.digests.DEFAULT_CHUNK_SIZE (not imported: the CLI starts without the store)


def chunk_size(text: str) -> int:
    """``--chunk-size``: the node flag's units and bounds (4KiB to 4MiB, adapter_fabric.units)."""
    try:
        return parse_chunk_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (fabric-node --chunk-size's bounds)") from None


def private_key_file(path: str, flag: str) -> bytes:
    """The bytes of the Ed25519 private key ``flag`` names, checked to be one; ``InvalidArgument`` naming the flag otherwise."""
    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.trust.signing import load_private_key

    data = read_input(path, flag, KEY_FIX)
    try:
        load_private_key(data)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{flag} {path}: {exc}") from None
    return data


def cmd_keygen(args: argparse.Namespace) -> None:
    """Write ``OUT.key`` (private, PEM, mode 0600) and ``OUT.pub`` (public, PEM: give it to nodes' --trusted-signers)."""
    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.trust.signing import keygen, load_public_key, raw_public_key

    key_path, pub_path = Path(f"{args.out}.key"), Path(f"{args.out}.pub")
    writable_parent(key_path, "OUT")
    for path in (key_path, pub_path):
        if path.exists():  # an error like any other, so --json reports it as JSON (exit 1)
            raise InvalidArgument(f"{path} exists: not overwriting a key (give another name, or move the old pair away first)")
    private, public = keygen()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub_path.write_bytes(public)
    signer = raw_public_key(load_public_key(public)).hex()  # as fabric inspect names the adapters it signed
    emit(args.json, {"private_key": str(key_path), "public_key": str(pub_path), "signer": signer},
         f"wrote {key_path} (keep it secret) and {pub_path} (for --trusted-signers); signer {signer}")


def cmd_sign(args: argparse.Namespace) -> None:
    """Sign a PEFT directory's digest by ``--key``: print it, and with ``--out`` write the file ``fabric stage --signature`` attaches."""
    from adapter_fabric.client.adapter_dir import adapter_files
    from adapter_fabric.store.manifest import build_manifest
    from adapter_fabric.trust.signing import sign

    key = private_key_file(args.key, "--key")  # before the directory is hashed: a wrong key path is said at once
    if args.out:
        writable_parent(args.out, "--out")
    config_path, weights_path = adapter_files(args.dir)
    manifest = build_manifest("signing", config_path.read_bytes(), weights_path, args.chunk_size)
    signed = sign(key, manifest.digest)
    payload = {"digest": manifest.digest, "signer": signed.signer, "signature": signed.signature.hex(), "chunk_size": args.chunk_size}
    text = f"digest={manifest.digest} signer={signed.signer} signature={signed.signature.hex()}"
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        text += f"\nwrote {args.out}: attach it with fabric stage NODE {args.dir} --id ID --signature {args.out}"
    emit(args.json, payload, text)


def read_signature_file(path: str, flag: str = "--signature"):
    """The ``Signed`` a ``fabric sign --out`` file holds; ``InvalidArgument`` naming the flag and the file otherwise."""
    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.trust.signing import Signed

    data = read_input(path, flag, "give the file fabric sign DIR --key KEY --out FILE wrote")
    try:
        found = json.loads(data)
        signed = Signed(bytes.fromhex(found["signer"]), bytes.fromhex(found["signature"]))
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument(f"{flag} {path}: not a signature file (fabric sign DIR --key KEY --out FILE writes one)") from None
    return signed


def register(command) -> None:
    """Add ``keygen`` and ``sign`` through ``command(name, handler, help, node=False)`` (see ``adapter_fabric.cli.main``)."""
    p = command("keygen", cmd_keygen, "make an Ed25519 key pair for signing adapters (OUT.key, OUT.pub)", node=False)
    p.add_argument("out", help="path prefix: writes OUT.key and OUT.pub")
    p = command("sign", cmd_sign, "sign an adapter directory's digest by --key, without a node: print the signature, and with "
                "--out write the file fabric stage --signature attaches (the private key stays where you sign)", node=False)
    p.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--key", required=True, help="private key (PEM, as fabric keygen writes it)")
    p.add_argument("--out", help="write the signature to this file, for fabric stage NODE DIR --id ID --signature FILE")
    p.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK_SIZE,
                   help="the chunk size of the nodes that will stage it (part of the digest; default 1 MiB, as fabric-node's; "
                   "4KiB to 4MiB, Ki/KiB = 1024 bytes, K/KB = 1000)")
