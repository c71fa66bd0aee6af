"""The node's flags. Each has an environment variable of the same name (FABRIC_<FLAG>).

Values are parsed strictly, the same way from the command line and from the
environment: ``FABRIC_SLOTS=abc`` or ``FABRIC_AUTH_PEER_READS=ture`` stop the
node with one line naming the variable and what it takes, instead of a
traceback or a silent default. An empty variable counts as unset. The
environment is read after argparse, so ``--help`` and ``--version`` work
whatever it holds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from adapter_fabric.exit_codes import EXIT_USAGE
from adapter_fabric.node.flag_values import (
    base_model_names,
    boolean,
    choice,
    chunk_size,
    csv,
    data_port,
    duration,
    engine_urls,
    evict_to,
    homes_count,
    host_port,
    k8s_target,
    optional_host_port,
    optional_path,
    origin_concurrency,
    path,
    path_list,
    peer_host_port,
    peer_list,
    positive_duration,
    positive_int,
    positive_size,
    sglang_url,
    size,
    sync_interval,
    upload_slots,
)
from adapter_fabric.node.upload_slots import SLOT_LEASE_S, SLOT_WAIT_S, UPLOAD_SLOTS
from adapter_fabric.origins.uri import origin_list as origin_uris
from adapter_fabric.rpc.limits import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_STREAMS_PER_PEER
from adapter_fabric.serving.names import DEFAULT_TARGET_MODULES
from adapter_fabric.store.digests import DEFAULT_CHUNK_SIZE
from adapter_fabric.transport.pull_values import STALL_TIMEOUT_S
from adapter_fabric.units import UNITS_HELP, format_duration, format_size

STORE_ONLY = "none"
PROG = "fabric-node"


@dataclass(frozen=True)
class NodeSettings:
    """Every flag's value, parsed and checked by ``parse_settings`` (from the command line, else the environment, else the default).

    No field has a default of its own: the flag table (``FLAGS``) is the one place a default is written.
    """

    listen: str
    store: Path
    model: str  # "tiny", a preset, a local directory, or "none" for a store-only seeder
    device: str
    slots: int
    max_rank: int
    target_modules: tuple[str, ...]
    peers: tuple[str, ...]
    log_level: str
    base_model: tuple[str, ...]  # more names of --model that adapters' base_model_name_or_path may give (adapter_fabric.format.base_model)
    chunk_size: int
    upload_rate: int  # bytes/s served to peers; 0 = unlimited
    stall_timeout: float
    download_rate: int  # bytes/s this node pulls from peers in all; 0 = unlimited
    peers_dns: str  # NAME:PORT resolving to many peers (a headless service), re-resolved per pull
    peers_k8s: str  # [NAMESPACE/]SERVICE:PORT whose ready EndpointSlice addresses are members (watched); "" = none
    homes: int  # homes per adapter id among the members (rendezvous hashing, node.homes); 0 = no placement
    # security: TLS files (a CA makes it mutual TLS) and the bearer token
    tls_cert: Path | None
    tls_key: Path | None
    tls_ca: Path | None
    auth_token_file: Path | None
    peer_token_file: Path | None  # the token sent to members; None: --auth-token-file's without --policy, none under it
    non_member_peers: str  # a Promote naming a non-member peer: refused, or dialled with no credential ("anonymous")
    auth_peer_reads: bool
    policy: Path | None  # the access policy (adapter_fabric.access): principals, their verbs on id prefixes, per-tenant quotas
    peer_tls_name: str  # the name peers' certificates are verified against when dialled by IP; empty = the address dialled
    # limits
    max_adapter_bytes: int
    max_header_bytes: int
    max_streams_per_peer: int
    upload_slots: int  # Fetch streams sent at once; others wait their turn, at most node.upload_slots.SLOT_WAIT_S
    max_store_bytes: int  # 0 = no limit but the disk
    when_full: str  # at --max-store-bytes: evict cold adapters (least recently used), or refuse the commit (a durable node)
    evict_to: float  # the share of --max-store-bytes an eviction frees down to
    max_new_tokens: int  # tokens one Generate may ask for
    scrub_rate: int  # bytes/s the background re-verification of the store reads; 0 = off
    trusted_signers: tuple[Path, ...]  # public keys: when any, only adapters they signed are staged, pulled, loaded, served
    export_dir: Path | None  # every staged adapter appears here as a PEFT directory (adapter_fabric.store.export)
    engine_url: tuple[str, ...]  # engines whose registered adapters (GET /v1/models) are held and shown (node.engines)
    sglang_url: str  # an SGLang server the node drives: it loads what the export dir holds (node.engine_drive); "" = none
    sglang_sync_interval: float  # seconds between two reconciles of the driven SGLang (and after each store change)
    # origins (adapter_fabric.origins, node.origin_fetch): where a miss the cluster cannot serve is fetched from, in order
    origin: tuple[str, ...]
    origin_ttl: float  # seconds an id fetched from an origin is served before a request revalidates it
    origin_timeout: float  # seconds one fetch from an origin may take (both files, retries included)
    origin_concurrency: int  # origin fetches this node runs at once
    # operations
    metrics_listen: str  # HOST:PORT of the plain-HTTP /metrics, /healthz, /readyz listener; empty = off
    metrics_read_timeout: float  # seconds a metrics-port connection may stay silent before it is closed
    metrics_adapter_labels: bool  # /metrics names resident adapters by id (else: slot and content id only)
    log_format: str
    drain_timeout: float  # seconds in-flight calls get after SIGTERM before they are cut
    expire_abandoned_after: float  # seconds; 0 = never
    data_port: int  # the data channel's port on --listen's host: 0 = a free one, -1 = off (peers then fetch over gRPC)

    @property
    def store_only(self) -> bool:
        return self.model == STORE_ONLY

    @property
    def durable(self) -> bool:
        """A durable node never evicts (--when-full refuse) and says so to its peers: the cluster's copies of last resort."""
        return self.when_full == "refuse"


# ---------------------------------------------------------------- the flags

#: (flag, parser, default, help, group); the default is what applies when neither the flag nor its variable is set
FLAGS: list[tuple[str, Callable[[str], Any], Any, str, str]] = [
    ("--listen", host_port, "127.0.0.1:50051", "HOST:PORT to serve on (port 0 picks a free one)", ""),
    ("--store", path, Path("./fabric-store"), "directory of the adapter store", ""),
    ("--model", str, "tiny", "'tiny', 'tiny-mistral', 'tiny-qwen2', a local transformers model directory, or 'none' (store-only seeder)", ""),
    ("--base-model", base_model_names, (), "other names of --model that adapters may give as base_model_name_or_path, comma-separated (a promote "
     "refuses an adapter for another model; --model's own name and its directory's name always match, without case or hub organisation)", ""),
    ("--device", choice("auto", "cpu", "cuda"), "auto", "where the slot pool lives: auto, cpu or cuda (auto = CUDA when present)", ""),
    ("--slots", positive_int, 4, "adapter slots in the pool", ""),
    ("--max-rank", positive_int, 16, "largest LoRA rank a slot holds", ""),
    ("--target-modules", csv, tuple(DEFAULT_TARGET_MODULES), "comma-separated linear module names the pool adapts", ""),
    ("--peers", peer_list, (), "comma-separated HOST:PORT of known peers (failover and lookup)", ""),
    ("--chunk-size", chunk_size, DEFAULT_CHUNK_SIZE, "bytes per verified chunk of newly staged adapters (4 KiB to 4 MiB); part of their digest, so "
     "keep one value across a cluster (pulled adapters keep their stager's)", ""),
    ("--upload-rate", size, 0, "bytes/s this node serves to peers in all; 0 = unlimited", ""),
    ("--download-rate", size, 0, "bytes/s this node pulls from peers in all; 0 = unlimited", ""),
    ("--peers-dns", lambda t: peer_host_port(t) if t else "", "", "NAME:PORT whose addresses are peers too (e.g. a Kubernetes headless service); re-resolved on every pull", ""),
    ("--peers-k8s", k8s_target, "", "[NAMESPACE/]SERVICE:PORT: the Service's ready EndpointSlice addresses are members too, watched through the "
     "Kubernetes API (needs get, list, watch on endpointslices: deploy/rbac.yaml; the namespace defaults to the pod's own)", ""),
    ("--homes", homes_count, 3, "homes per adapter id among the members (rendezvous hashing): a Stage's node pushes it "
     "there, a pull naming no peer asks them first, eviction keeps their copies last; 0 = no placement (every peer is asked, "
     "the mesh of earlier releases)", ""),
    ("--export-dir", optional_path, None, "keep every staged adapter here as a PEFT directory <id with / as %%2F>/ (hard links; same filesystem as --store), for vLLM or SGLang beside the node", ""),
    ("--engine-url", engine_urls, (), "comma-separated base URLs of inference engines beside this node (e.g. http://127.0.0.1:8000): "
     "what each lists in GET /v1/models is shown by fabric ls and never evicted from the export directory", ""),
    ("--sglang-url", sglang_url, "", "base URL of an SGLang server this node drives (e.g. http://127.0.0.1:30000; needs --export-dir): "
     "it loads every exported adapter under its export name and unloads those the node no longer holds (before evicting them)", ""),
    ("--sglang-sync-interval", sync_interval, 10.0, "with --sglang-url: how often the node brings SGLang in step (1s to 1h; also right after each store change)", ""),
    ("--origin", origin_uris, (), "where adapters live, tried in order after the node's peers on a miss (repeat the flag; "
     "space-separated in the variable): s3://bucket/prefix, hf:// or hf://ORG, https://host/prefix, http://, file:///path; "
     "options after '#': trusted (a --trusted-signers node takes its content unsigned), timeout=DURATION", "origins"),
    ("--origin-ttl", duration, 300.0, "how long an id fetched from an origin is served before the next request revalidates it "
     "(a conditional request; a changed origin moves the id to the new digest); 0 = every request", "origins"),
    ("--origin-timeout", positive_duration, 60.0, "bound on one fetch from an origin, both files and retries included (a slow drip is refused at it)", "origins"),
    ("--origin-concurrency", origin_concurrency, 4, "origin fetches this node runs at once (requests for one id always share one)", "origins"),
    ("--data-port", data_port, 0, "port of the data channel that carries chunk bytes to peers beside gRPC, on --listen's host "
     "(same TLS and token as gRPC; 0 = a free port, announced to peers; off = peers fetch over gRPC)", ""),
    ("--stall-timeout", positive_duration, STALL_TIMEOUT_S, "seconds without a byte before a peer's stream is dropped and the pull fails over "
     "(and before this node's data channel cuts a peer that stopped reading)", ""),
    ("--tls-cert", optional_path, None, "PEM certificate chain this node serves with and presents to peers; with --tls-key turns TLS on", "security"),
    ("--tls-key", optional_path, None, "PEM private key of --tls-cert", "security"),
    ("--tls-ca", optional_path, None, "PEM CA bundle: verifies peers' servers, and clients must present a certificate it signed (mutual TLS)", "security"),
    ("--auth-token-file", optional_path, None, "file holding the cluster's bearer token: calls must carry it; without --policy it is also what this node sends its peers", "security"),
    ("--peer-token-file", optional_path, None, "file holding the token this node sends its members (--peers, --peers-dns); never --auth-token-file's under --policy", "security"),
    ("--non-member-peers", choice("refuse", "anonymous"), "refuse", "a Promote naming a peer that is not a member (--peers, --peers-dns, "
     "or a certificate proving --peer-tls-name): 'refuse' it before dialling, or dial it 'anonymous' (no token, no certificate)", "security"),
    ("--peer-tls-name", str, "", "with TLS: the name every peer's certificate must carry, checked instead of the address dialled "
     "(peers found through --peers-dns are dialled by pod IP; give the nodes one certificate naming e.g. the headless Service)", "security"),
    ("--auth-peer-reads", boolean, False, "also require the token for Fetch, GetManifest, Availability and Locate (else open to any peer)", "security"),
    ("--policy", optional_path, None, "TOML access policy: principals (a token's sha256, or a client certificate's SAN) and the verbs "
     "each may use on which id prefixes, and [[quota]] tables limiting the bytes and adapter ids each id prefix (tenant) may hold, "
     "beside --max-store-bytes; every call then needs a principal (peer reads too); reloaded on SIGHUP or when the file changes", "security"),
    ("--trusted-signers", path_list, (), "Ed25519 public keys (PEM or 32 raw bytes; space-separated, or comma-separated in the variable); "
     "when given, the node stages, pulls, loads and serves only adapters whose manifest one of them signed", "security"),
    ("--max-adapter-bytes", positive_size, DEFAULT_MAX_ADAPTER_BYTES, "largest adapter (config + weights) accepted by Stage or pulled from a peer", "limits"),
    ("--max-header-bytes", positive_size, DEFAULT_MAX_HEADER_BYTES, "largest safetensors header accepted", "limits"),
    ("--max-streams-per-peer", positive_int, DEFAULT_MAX_STREAMS_PER_PEER, "concurrent Fetch streams one peer host may hold open", "limits"),
    ("--upload-slots", upload_slots, UPLOAD_SLOTS, "Fetch streams this node sends at once; the others wait their turn, each at most "
     f"{SLOT_WAIT_S:g} s, then send anyway, and each keeps its slot {SLOT_LEASE_S:g} s at most (fewer at once land each chunk sooner: a swarm trades earlier)", "limits"),
    ("--max-store-bytes", size, 0, "total bytes the store may hold, partial downloads and uploads included; 0 = no limit but the disk", "limits"),
    ("--when-full", choice("evict", "refuse"), "evict", "at --max-store-bytes: 'evict' drops least recently used adapters (never kept, resident, "
     "in-use ones, or a last copy no durable peer took) down to --evict-to; 'refuse' makes a durable node: it never evicts, refuses "
     "the commit, and tells peers so (they hand it their last copies)", "limits"),
    ("--evict-to", evict_to, 0.9, "with --when-full evict: the share of --max-store-bytes an eviction frees down to (0.5 to 1.0), "
     "leaving room for the next commits without evicting again", "limits"),
    ("--max-new-tokens", positive_int, 256, "most tokens one Generate may ask for (each is a decode step on the model worker)", "limits"),
    ("--scrub-rate", size, 64 << 20, "bytes/s the store's background re-verification reads (at start, then every 6 h; it works at most a tenth of the time); 0 = off", "limits"),
    ("--expire-abandoned-after", duration, 24 * 3600.0, "age after which an untouched upload or partial download is removed (checked at start and periodically); 0 = never", "limits"),
    ("--metrics-listen", optional_host_port, "", "HOST:PORT of a plain-HTTP listener serving /metrics (Prometheus), /healthz and /readyz; off when empty", "operations"),
    ("--metrics-read-timeout", positive_duration, 10.0, "seconds a --metrics-listen connection may send nothing (mid-request or "
     "between requests) before the node closes it", "operations"),
    ("--metrics-adapter-labels", boolean, False, "name each resident adapter's id in fabric_resident_adapter_info (/metrics is unauthenticated)", "operations"),
    ("--log-format", choice("text", "json"), "text", "log lines as text (key=value) or json (one object a line)", "operations"),
    ("--log-level", choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "DEBUG, INFO, WARNING or ERROR (any case)", "operations"),
    ("--drain-timeout", positive_duration, 10.0, "seconds in-flight calls (Fetch streams too) get to finish after SIGTERM before they are cut", "operations"),
]
_BOOLEAN_FLAGS = {"--auth-peer-reads", "--metrics-adapter-labels"}
_MANY_FLAGS = {"--trusted-signers"}  # one or more values after the flag
_REPEATED_FLAGS = {"--origin"}  # the flag given again for each value


def env_name(flag: str) -> str:
    """``--max-rank`` -> ``FABRIC_MAX_RANK``."""
    return "FABRIC_" + flag.lstrip("-").upper().replace("-", "_")


_SIZE_PARSERS = (size, positive_size, chunk_size)
_DURATION_PARSERS = (duration, positive_duration, sync_interval)


def _shown(default: Any, parse: Callable[[str], Any]) -> str:
    """The default the way the README writes it: 4 GiB, 24h, none."""
    if parse in _SIZE_PARSERS and default:
        return format_size(default)
    if parse in _DURATION_PARSERS and default:
        return format_duration(default)
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return "none" if default in (None, "") else str(default)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2, as ``fabric``'s usage errors (adapter_fabric.cli.output)."""

    def error(self, message: str) -> NoReturn:
        usage_error(f"{message} (see {PROG} --help)")


def usage_error(message: str) -> NoReturn:
    """Stop the process with one line on stderr and status 2: a bad flag or variable, the same code ``fabric`` uses."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def fail(message: str) -> NoReturn:
    """Stop the process with one line on stderr and status 1 (Python prints a SystemExit's message so)."""
    raise SystemExit(f"{PROG}: {message}")


def _argparse_type(flag: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    convert.__name__ = flag  # argparse names the type in some messages
    return convert


def build_parser() -> argparse.ArgumentParser:
    from adapter_fabric import __version__

    parser = _Parser(
        prog=PROG,
        description="Run an adapter-fabric node: stage adapters, serve them to peers, promote them into a slot pool.",
        epilog="Every flag can also be set by an environment variable: --max-rank is FABRIC_MAX_RANK, and so on "
        "(booleans: true/false, 1/0, yes/no, on/off; an empty variable counts as unset). " + UNITS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag, parse, default, text, group in FLAGS:
        where = groups.setdefault(group, parser.add_argument_group(group)) if group else parser
        help_text = f"{text} (default: {_shown(default, parse)}) [{env_name(flag)}]"
        if flag in _BOOLEAN_FLAGS:
            where.add_argument(flag, action="store_const", const=True, default=None, help=help_text)
        elif flag in _REPEATED_FLAGS:
            where.add_argument(flag, action="append", type=_argparse_type(flag, lambda t: origin_uris(t)[0] if t.split() else ""), default=None,
                               metavar="URI", help=help_text)  # fmt: skip
        elif flag in _MANY_FLAGS:
            where.add_argument(flag, nargs="+", type=_argparse_type(flag, path), default=None, metavar="FILE", help=help_text)
        else:
            where.add_argument(flag, type=_argparse_type(flag, parse), default=None, metavar=flag.lstrip("-").upper().replace("-", "_"), help=help_text)
    return parser


def parse_settings(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> NodeSettings:
    """The settings from ``argv`` and ``environ`` (flags win); a bad value ends the process with one line (status 2)."""
    args = build_parser().parse_args(argv)
    env: Mapping[str, str] = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for flag, parse, default, _, _ in FLAGS:
        dest = flag.lstrip("-").replace("-", "_")
        value = getattr(args, dest)
        if isinstance(value, list):
            value = tuple(v for v in value if v != "")
        if value is None:
            raw = env.get(env_name(flag), "")
            if raw:
                try:
                    value = parse(raw)
                except ValueError as exc:
                    usage_error(f"environment variable {env_name(flag)}={raw!r} (for {flag}): {exc}")
            else:
                value = default
        values[dest] = value
    if len(values["origin"]) > 16:
        usage_error(f"--origin: at most 16 origins, got {len(values['origin'])}")
    if values["peers_k8s"] and not values["homes"]:
        usage_error("--peers-k8s needs --homes (1 or more; 3 by default): its EndpointSlices are the members adapters are homed on; with --homes 0 the node asks only --peers and --peers-dns")
    if values["sglang_url"] and values["export_dir"] is None:
        usage_error("--sglang-url needs --export-dir: SGLang loads the adapters from the node's export directory")
    return NodeSettings(**values)
