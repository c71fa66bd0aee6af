"""The node's flag values: each parser takes a flag's (or its variable's) text and returns the value, or raises ValueError
saying what is expected (``adapter_fabric.node.settings`` turns that into one line naming the flag or variable)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.integrations.engine_models import check_engine_url
from adapter_fabric.transport.endpoint_slices import parse_target
from adapter_fabric.units import format_duration, parse_chunk_size, parse_duration, parse_size

_DIGITS = re.compile(r"[0-9]+")


def positive_int(text: str) -> int:
    if not _DIGITS.fullmatch(text) or int(text) <= 0:
        raise ValueError("expected a positive integer")
    return int(text)


def chunk_size(text: str) -> int:
    return parse_chunk_size(text)


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


def k8s_target(text: str) -> str:
    """``[NAMESPACE/]SERVICE:PORT`` (--peers-k8s), checked now; the namespace is read from the pod when the node runs."""
    if not text:
        return ""
    try:
        parse_target(text, default_namespace=lambda: "default")
    except InvalidArgument as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None
    return text


#: --origin-concurrency's bound: each fetch holds an I/O thread and a connection to its origin
MAX_ORIGIN_CONCURRENCY = 64


def _whole_number(text: str, low: int, high: int) -> int:
    if not _DIGITS.fullmatch(text) or not low <= int(text) <= high:
        raise ValueError(f"expected a whole number from {low} to {high}")
    return int(text)


def origin_concurrency(text: str) -> int:
    """Origin fetches at once: 1 to MAX_ORIGIN_CONCURRENCY."""
    return _whole_number(text, 1, MAX_ORIGIN_CONCURRENCY)


#: --upload-slots at most: past the data channel's 256 connections and gRPC's streams, a bound that no longer bounds
MAX_UPLOAD_SLOTS = 1024


def upload_slots(text: str) -> int:
    """Fetch streams sent at once: 1 to MAX_UPLOAD_SLOTS."""
    return _whole_number(text, 1, MAX_UPLOAD_SLOTS)


#: --base-model's bounds: a few aliases of one model, each a path or hub id
MAX_BASE_MODEL_NAMES, MAX_BASE_MODEL_NAME_CHARS = 16, 512


def base_model_names(text: str) -> tuple[str, ...]:
    """Comma-separated other names of --model: at most MAX_BASE_MODEL_NAMES, each at most MAX_BASE_MODEL_NAME_CHARS."""
    names = csv(text)
    if len(names) > MAX_BASE_MODEL_NAMES:
        raise ValueError(f"at most {MAX_BASE_MODEL_NAMES} names, got {len(names)}")
    if any(len(name) > MAX_BASE_MODEL_NAME_CHARS or "\0" in name for name in names):
        raise ValueError(f"each name is a path or hub id of at most {MAX_BASE_MODEL_NAME_CHARS} characters")
    return names


def homes_count(text: str) -> int:
    if not _DIGITS.fullmatch(text) or int(text) > 64:
        raise ValueError("expected a whole number from 0 (no placement) to 64")
    return int(text)


def choice(*options: str) -> Callable[[str], str]:
    """One of ``options``, in any case (``--log-level debug`` is DEBUG), returned as ``options`` writes it."""
    by_folded = {option.casefold(): option for option in options}

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
