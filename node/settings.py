"""The node's flags. Each has an environment variable of the same name (FABRIC_<FLAG>)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fabric.rpc.limits import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_STREAMS_PER_PEER
from fabric.serving.tiny import DEFAULT_TARGET_MODULES

STORE_ONLY = "none"


@dataclass(frozen=True)
class NodeSettings:
    listen: str
    store: Path
    model: str  # "tiny", a preset, a local directory, or "none" for a store-only seeder
    device: str
    slots: int
    max_rank: int
    target_modules: tuple[str, ...]
    peers: tuple[str, ...]
    log_level: str
    chunk_size: int = 1 << 20
    upload_rate: int = 0  # bytes/s served to peers; 0 = unlimited
    stall_timeout: float = 10.0
    download_rate: int = 0  # bytes/s this node pulls from peers in all; 0 = unlimited
    peers_dns: str = ""  # NAME:PORT resolving to many peers (a headless service), re-resolved per pull
    # security: TLS files (a CA makes it mutual TLS) and the bearer token
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    auth_token_file: Path | None = None
    auth_peer_reads: bool = False
    # limits
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_streams_per_peer: int = DEFAULT_MAX_STREAMS_PER_PEER
    max_store_bytes: int = 0  # 0 = no limit but the disk
    max_new_tokens: int = 256  # tokens one Generate may ask for
    scrub_rate: int = 64 << 20  # bytes/s the background re-verification of the store reads; 0 = off
    trusted_signers: tuple[Path, ...] = ()  # public keys: when any, only adapters they signed are staged, pulled, loaded, served
    export_dir: Path | None = None  # every staged adapter appears here as a PEFT directory (fabric.store.export)

    @property
    def store_only(self) -> bool:
        return self.model == STORE_ONLY


def _env(name: str, default: str) -> str:
    return os.environ.get(f"FABRIC_{name.upper().replace('-', '_')}", default)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return number


def _path_or_none(value: str) -> Path | None:
    return Path(value) if value else None


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric-node",
        description="Run an adapter-fabric node: stage adapters, serve them to peers, promote them into a slot pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag can also be set by an environment variable: --max-rank is FABRIC_MAX_RANK, and so on.",
    )
    parser.add_argument("--listen", default=_env("listen", "127.0.0.1:50051"), help="host:port to serve on (port 0 picks a free one)")
    parser.add_argument("--store", default=_env("store", "./fabric-store"), help="directory of the adapter store")
    parser.add_argument("--model", default=_env("model", "tiny"), help="'tiny', 'tiny-mistral', 'tiny-qwen2', a local transformers model directory, or 'none' (store-only seeder)")
    parser.add_argument("--device", default=_env("device", "auto"), choices=["auto", "cpu", "cuda"], help="where the slot pool lives; auto = CUDA when present")
    parser.add_argument("--slots", type=_positive, default=int(_env("slots", "4")), help="adapter slots in the pool")
    parser.add_argument("--max-rank", type=_positive, default=int(_env("max_rank", "16")), help="largest LoRA rank a slot holds")
    parser.add_argument("--target-modules", default=_env("target_modules", ",".join(DEFAULT_TARGET_MODULES)), help="comma-separated linear module names the pool adapts")
    parser.add_argument("--peers", default=_env("peers", ""), help="comma-separated host:port of known peers (failover and lookup)")
    parser.add_argument("--chunk-size", type=_positive, default=int(_env("chunk_size", str(1 << 20))), help="bytes per verified chunk of newly staged adapters (4 KiB to 4 MiB)")
    parser.add_argument("--upload-rate", type=int, default=int(_env("upload_rate", "0")), help="bytes/s this node serves to peers in all; 0 = unlimited")
    parser.add_argument("--download-rate", type=int, default=int(_env("download_rate", "0")), help="bytes/s this node pulls from peers in all; 0 = unlimited")
    parser.add_argument("--peers-dns", default=_env("peers_dns", ""), help="NAME:PORT whose addresses are peers too (e.g. a Kubernetes headless service); re-resolved on every pull")
    parser.add_argument("--export-dir", type=_path_or_none, default=_env("export_dir", ""), help="keep every staged adapter here as a PEFT directory <id with / as %%2F>/ (hard links; same filesystem as --store), for vLLM or SGLang beside the node")
    parser.add_argument("--stall-timeout", type=float, default=float(_env("stall_timeout", "10")), help="seconds without a byte before a peer's stream is dropped and the pull fails over")
    security = parser.add_argument_group("security (see README: Running a secure cluster)")
    security.add_argument("--tls-cert", type=_path_or_none, default=_env("tls_cert", ""), help="PEM certificate chain this node serves with and presents to peers; with --tls-key turns TLS on")
    security.add_argument("--tls-key", type=_path_or_none, default=_env("tls_key", ""), help="PEM private key of --tls-cert")
    security.add_argument("--tls-ca", type=_path_or_none, default=_env("tls_ca", ""), help="PEM CA bundle: verifies peers' servers, and clients must present a certificate it signed (mutual TLS)")
    security.add_argument("--auth-token-file", type=_path_or_none, default=_env("auth_token_file", ""), help="file holding the cluster's bearer token: calls must carry it, and this node sends it to peers")
    security.add_argument("--auth-peer-reads", action="store_true", default=_truthy(_env("auth_peer_reads", "")), help="also require the token for Fetch, GetManifest, Availability and Locate (else open to any peer)")
    security.add_argument("--trusted-signers", nargs="+", type=Path, default=[Path(p) for p in _csv(_env("trusted_signers", ""))], metavar="FILE", help="Ed25519 public keys (PEM or 32 raw bytes); when given, the node stages, pulls, loads and serves only adapters whose manifest one of them signed")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-adapter-bytes", type=_positive, default=int(_env("max_adapter_bytes", str(DEFAULT_MAX_ADAPTER_BYTES))), help="largest adapter (config + weights) accepted by Stage or pulled from a peer")
    limits.add_argument("--max-header-bytes", type=_positive, default=int(_env("max_header_bytes", str(DEFAULT_MAX_HEADER_BYTES))), help="largest safetensors header accepted")
    limits.add_argument("--max-streams-per-peer", type=_positive, default=int(_env("max_streams_per_peer", str(DEFAULT_MAX_STREAMS_PER_PEER))), help="concurrent Fetch streams one peer host may hold open")
    limits.add_argument("--max-store-bytes", type=_non_negative, default=int(_env("max_store_bytes", "0")), help="total bytes the store may hold, partial downloads and uploads included; 0 = no limit but the disk")
    limits.add_argument("--max-new-tokens", type=_positive, default=int(_env("max_new_tokens", "256")), help="most tokens one Generate may ask for (each is a decode step on the model worker)")
    limits.add_argument("--scrub-rate", type=_non_negative, default=int(_env("scrub_rate", str(64 << 20))), help="bytes/s the store's background re-verification reads (at start, then every 6 h); 0 = off")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    for action in parser._actions:  # name each flag's variable in --help
        if action.option_strings and action.dest != "help":
            action.help = f"{action.help or ''} [{'FABRIC_' + action.dest.upper()}]".strip()
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> NodeSettings:
    args = build_parser().parse_args(argv)
    return NodeSettings(
        listen=args.listen,
        store=Path(args.store),
        model=args.model,
        device=args.device,
        slots=args.slots,
        max_rank=args.max_rank,
        target_modules=_csv(args.target_modules),
        peers=_csv(args.peers),
        log_level=args.log_level,
        chunk_size=args.chunk_size,
        upload_rate=args.upload_rate,
        stall_timeout=args.stall_timeout,
        download_rate=args.download_rate,
        peers_dns=args.peers_dns,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        auth_token_file=args.auth_token_file,
        auth_peer_reads=args.auth_peer_reads,
        max_adapter_bytes=args.max_adapter_bytes,
        max_header_bytes=args.max_header_bytes,
        max_streams_per_peer=args.max_streams_per_peer,
        max_store_bytes=args.max_store_bytes,
        max_new_tokens=args.max_new_tokens,
        scrub_rate=args.scrub_rate,
        trusted_signers=tuple(args.trusted_signers),
        export_dir=args.export_dir,
    )
