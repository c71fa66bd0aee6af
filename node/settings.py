"""The node's flags. Each has an environment variable of the same name (FABRIC_<FLAG>)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fabric.tiny import DEFAULT_TARGET_MODULES

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
    parser.add_argument("--stall-timeout", type=float, default=float(_env("stall_timeout", "10")), help="seconds without a byte before a peer's stream is dropped and the pull fails over")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"])
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
    )
