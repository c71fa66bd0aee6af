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
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.exit_codes import EXIT_USAGE
from adapter_fabric.integrations.engine_models import check_engine_url
from adapter_fabric.origins.uri import origin_list as origin_uris
from adapter_fabric.rpc.limits import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_STREAMS_PER_PEER
from adapter_fabric.serving.names import DEFAULT_TARGET_MODULES
from adapter_fabric.units import UNITS_HELP, format_duration, format_size, parse_chunk_size, parse_duration, parse_size

STORE_ONLY = "none"
PROG = "fabric-node"


@dataclass(frozen=True)
class NodeSettings:
    """Every flag's value, parsed and checked by ``parse_settings`` (from the command line, else the environment, else the default)."""

    listen: str
    store: Path
    model: str  # "tiny", a preset, a local directory, or "none" for a store-only seeder
    device: str
    slots: int
    max_rank: int
    target_modules: tuple[str, ...]
    peers: tuple[str, ...]
    log_level: str
    base_model: tuple[str, ...] = ()  # more names of --model that adapters' base_model_name_or_path may give (adapter_fabric.format.base_model)
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
    policy: Path | None = None  # the access policy (adapter_fabric.access): principals, their verbs on id prefixes, per-tenant quotas
    peer_tls_name: str = ""  # the name peers' certificates are verified against when dialled by IP; empty = the address dialled
    # limits
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_streams_per_peer: int = DEFAULT_MAX_STREAMS_PER_PEER
    max_store_bytes: int = 0  # 0 = no limit but the disk
    when_full: str = "evict"  # at --max-store-bytes: evict cold adapters (least recently used), or refuse the commit (a durable node)
    evict_to: float = 0.9  # the share of --max-store-bytes an eviction frees down to
    max_new_tokens: int = 256  # tokens one Generate may ask for
    scrub_rate: int = 64 << 20  # bytes/s the background re-verification of the store reads; 0 = off
    trusted_signers: tuple[Path, ...] = ()  # public keys: when any, only adapters they signed are staged, pulled, loaded, served
    export_dir: Path | None = None  # every staged adapter appears here as a PEFT directory (adapter_fabric.store.export)
    engine_url: tuple[str, ...] = ()  # engines whose registered adapters (GET /v1/models) are held and shown (node.engines)
    sglang_url: str = ""  # an SGLang server the node drives: it loads what the export dir holds (node.engine_drive); "" = none
    sglang_sync_interval: float = 10.0  # seconds between two reconciles of the driven SGLang (and after each store change)
    # origins (adapter_fabric.origins, node.origin_fetch): where a miss the cluster cannot serve is fetched from, in order
    origin: tuple[str, ...] = ()
    origin_ttl: float = 300.0  # seconds an id fetched from an origin is served before a request revalidates it
    origin_timeout: float = 60.0  # seconds one fetch from an origin may take (both files, retries included)
    origin_concurrency: int = 4  # origin fetches this node runs at once
    # operations
    metrics_listen: str = ""  # HOST:PORT of the plain-HTTP /metrics, /healthz, /readyz listener; empty = off
    metrics_read_timeout: float = 10.0  # seconds a metrics-port connection may stay silent before it is closed
    log_format: str = "text"
    drain_timeout: float = 10.0  # seconds in-flight calls get after SIGTERM before they are cut
    expire_abandoned_after: float = 24 * 3600.0  # seconds; 0 = never
    data_port: int = 0  # the data channel's port on --listen's host: 0 = a free one, -1 = off (peers then fetch over gRPC)

    @property
    def store_only(self) -> bool:
        return self.model == STORE_ONLY

    @property
    def durable(self) -> bool:
        """A durable node never evicts (--when-full refuse) and says so to its peers: the cluster's copies of last resort."""
        return self.when_full == "refuse"


# ---------------------------------------------------------------- strict value parsers
# Each takes the raw text and returns the value, or raises ValueError saying what is expected.

_DIGITS = re.compile(r"[0-9]+")


def positive_int(text: str) -> int:
    if not _DIGITS.fullmatch(text) or int(text) <= 0:
        raise ValueError("expected a positive integer")
    return int(text)


chunk_size = parse_chunk_size  # 4KiB to 4MiB


def duration(text: str) -> float:
    """Seconds (adapter_fabric.units): ``90``, ``90s``, ``15m``, ``24h``, ``7d``; 0 turns the feature off."""
    return parse_duration(text)


def positive_duration(text: str) -> float:
    return parse_duration(text, allow_zero=False)


def size(text: str) -> int:
    """Bytes (adapter_fabric.units): ``4096``, ``64MiB``, ``18GiB``; 0 where the flag says so."""
    return parse_size(text)


def positive_size(text: str) -> int:
    return parse_size(text, allow_zero=False)


def data_port(text: str) -> int:
    """A port for the data channel: 1-65535, 0 for a free one, or ``off`` (-1)."""
    if text.strip().lower() == "off":
        return -1
    if not _DIGITS.fullmatch(text) or int(text) > 65535:
        raise ValueError("expected a port from 1 to 65535, 0 (a free port), or off")
    return int(text)


#: --evict-to's bounds: below half the limit one eviction would drop more than the store keeps
EVICT_TO_MIN, EVICT_TO_MAX = 0.5, 1.0


def evict_to(text: str) -> float:
    """A share of --max-store-bytes an eviction frees down to: a decimal from 0.5 to 1.0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not EVICT_TO_MIN <= value <= EVICT_TO_MAX:  # also refuses nan and inf
        raise ValueError(f"expected a share of --max-store-bytes from {EVICT_TO_MIN} to {EVICT_TO_MAX} (for example 0.9)")
    return value


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false (also 1/0, yes/no, on/off)")


def host_port(text: str, *, allow_zero: bool = True) -> str:
    """``host:port`` or ``[v6]:port`` with a port in range; returned as given."""
    host, sep, port = text.rpartition(":")
    low = 0 if allow_zero else 1
    if not sep or not host.strip("[]") or not _DIGITS.fullmatch(port) or not low <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port from {low} to 65535 (for example 0.0.0.0:50051)")
    return text


def peer_host_port(text: str) -> str:
    return host_port(text, allow_zero=False)


def csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def peer_list(text: str) -> tuple[str, ...]:
    return tuple(peer_host_port(item) for item in csv(text))


def choice(*options: str) -> Callable[[str], str]:
    by_folded = {option.casefold(): option for option in options}  # any case (--log-level debug), returned as options writes it

    def parse(text: str) -> str:
        if text.strip().casefold() not in by_folded:
            raise ValueError(f"expected one of {', '.join(options)}")
        return by_folded[text.strip().casefold()]

    return parse


def path(text: str) -> Path:
    if "\0" in text:
        raise ValueError("expected a file path")
    return Path(text)


def optional_path(text: str) -> Path | None:
    return path(text) if text else None


def path_list(text: str) -> tuple[Path, ...]:
    return tuple(path(item) for item in csv(text))


#: engines one node watches at most (a sidecar has one; a few share a node at most)
MAX_ENGINES = 8


def engine_urls(text: str) -> tuple[str, ...]:
    """Comma-separated http(s) base URLs of inference engines (adapter_fabric.integrations.engine_models), at most MAX_ENGINES."""
    try:
        urls = tuple(dict.fromkeys(check_engine_url(item) for item in csv(text)))
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    if len(urls) > MAX_ENGINES:
        raise ValueError(f"at most {MAX_ENGINES} engine URLs, got {len(urls)}")
    return urls


def sglang_url(text: str) -> str:
    """One http(s) base URL of an SGLang server (adapter_fabric.integrations.engine_models.check_engine_url); "" = none."""
    if not text:
        return ""
    try:
        return check_engine_url(text.strip())
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


#: --sglang-sync-interval's bounds: under 1 s the node would poll SGLang busily, over 1 h a restart goes unnoticed too long
SYNC_INTERVAL_MIN_S, SYNC_INTERVAL_MAX_S = 1.0, 3600.0


def sync_interval(text: str) -> float:
    """A duration (adapter_fabric.units) from 1s to 1h."""
    value = parse_duration(text, allow_zero=False)
    if not SYNC_INTERVAL_MIN_S <= value <= SYNC_INTERVAL_MAX_S:
        raise ValueError(f"expected a duration from {format_duration(SYNC_INTERVAL_MIN_S)} to {format_duration(SYNC_INTERVAL_MAX_S)}, such as 10s or 1m")
    return value


def optional_host_port(text: str) -> str:
    return host_port(text) if text else ""


# ---------------------------------------------------------------- the flags

#: (flag, parser, default, help, group); the default is what applies when neither the flag nor its variable is set
_FLAGS: list[tuple[str, Callable[[str], Any], Any, str, str]] = [
    ("--listen", host_port, "127.0.0.1:50051", "HOST:PORT to serve on (port 0 picks a free one)", ""),
    ("--store", path, Path("./fabric-store"), "directory of the adapter store", ""),
    ("--model", str, "tiny", "'tiny', 'tiny-mistral', 'tiny-qwen2', a local transformers model directory, or 'none' (store-only seeder)", ""),
    ("--base-model", csv, (), "more names of --model an adapter's base_model_name_or_path may give, comma-separated (a promote refuses another model's)", ""),
    ("--device", choice("auto", "cpu", "cuda"), "auto", "where the slot pool lives: auto, cpu or cuda (auto = CUDA when present)", ""),
    ("--slots", positive_int, 4, "adapter slots in the pool", ""),
    ("--max-rank", positive_int, 16, "largest LoRA rank a slot holds", ""),
    ("--target-modules", csv, tuple(DEFAULT_TARGET_MODULES), "comma-separated linear module names the pool adapts", ""),
    ("--peers", peer_list, (), "comma-separated HOST:PORT of known peers (failover and lookup)", ""),
    ("--chunk-size", chunk_size, 1 << 20, "bytes per verified chunk of newly staged adapters (4 KiB to 4 MiB); part of their digest, so "
     "keep one value across a cluster (pulled adapters keep their stager's)", ""),
    ("--upload-rate", size, 0, "bytes/s this node serves to peers in all; 0 = unlimited", ""),
    ("--download-rate", size, 0, "bytes/s this node pulls from peers in all; 0 = unlimited", ""),
    ("--peers-dns", lambda t: peer_host_port(t) if t else "", "", "NAME:PORT whose addresses are peers too (e.g. a Kubernetes headless service); re-resolved on every pull", ""),
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
    ("--origin-concurrency", positive_int, 4, "origin fetches this node runs at once (requests for one id always share one)", "origins"),
    ("--data-port", data_port, 0, "port of the data channel that carries chunk bytes to peers beside gRPC, on --listen's host "
     "(same TLS and token as gRPC; 0 = a free port, announced to peers; off = peers fetch over gRPC)", ""),
    ("--stall-timeout", positive_duration, 10.0, "seconds without a byte before a peer's stream is dropped and the pull fails over "
     "(and before this node's data channel cuts a peer that stopped reading)", ""),
    ("--tls-cert", optional_path, None, "PEM certificate chain this node serves with and presents to peers; with --tls-key turns TLS on", "security"),
    ("--tls-key", optional_path, None, "PEM private key of --tls-cert", "security"),
    ("--tls-ca", optional_path, None, "PEM CA bundle: verifies peers' servers, and clients must present a certificate it signed (mutual TLS)", "security"),
    ("--auth-token-file", optional_path, None, "file holding the cluster's bearer token: calls must carry it, and this node sends it to peers", "security"),
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
    ("--max-store-bytes", size, 0, "total bytes the store may hold, partial downloads and uploads included; 0 = no limit but the disk", "limits"),
    ("--when-full", choice("evict", "refuse"), "evict", "at --max-store-bytes: 'evict' drops least recently used adapters (never kept, resident, "
     "in-use ones, or a last copy no durable peer took) down to --evict-to; 'refuse' makes a durable node: it never evicts, refuses "
     "the commit, and tells peers so (they hand it their last copies)", "limits"),
    ("--evict-to", evict_to, 0.9, "with --when-full evict: the share of --max-store-bytes an eviction frees down to (0.5 to 1.0), "
     "leaving room for the next commits without evicting again", "limits"),
    ("--max-new-tokens", positive_int, 256, "most tokens one Generate may ask for (each is a decode step on the model worker)", "limits"),
    ("--scrub-rate", size, 64 << 20, "bytes/s the store's background re-verification reads (at start, then every 6 h); 0 = off", "limits"),
    ("--expire-abandoned-after", duration, 24 * 3600.0, "age after which an untouched upload or partial download is removed (checked at start and periodically); 0 = never", "limits"),
    ("--metrics-listen", optional_host_port, "", "HOST:PORT of a plain-HTTP listener serving /metrics (Prometheus), /healthz and /readyz; off when empty", "operations"),
    ("--metrics-read-timeout", positive_duration, 10.0, "seconds a --metrics-listen connection may send nothing (mid-request or "
     "between requests) before the node closes it", "operations"),
    ("--log-format", choice("text", "json"), "text", "log lines as text (key=value) or json (one object a line)", "operations"),
    ("--log-level", choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "DEBUG, INFO, WARNING or ERROR (any case)", "operations"),
    ("--drain-timeout", positive_duration, 10.0, "seconds in-flight calls (Fetch streams too) get to finish after SIGTERM before they are cut", "operations"),
]
_BOOLEAN_FLAGS = {"--auth-peer-reads"}
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
    for flag, parse, default, text, group in _FLAGS:
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
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for flag, parse, default, _, _ in _FLAGS:
        dest = flag.lstrip("-").replace("-", "_")
        value = getattr(args, dest)
        if isinstance(value, list):
            value = tuple(v for v in value if v != "")
        if value is None:
            raw = environ.get(env_name(flag), "")
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
    if values["sglang_url"] and values["export_dir"] is None:
        usage_error("--sglang-url needs --export-dir: SGLang loads the adapters from the node's export directory")
    return NodeSettings(**values)
