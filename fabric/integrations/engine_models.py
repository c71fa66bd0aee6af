"""What an inference engine has registered: the LoRA adapters its OpenAI ``GET /v1/models`` lists.

vLLM (``OpenAIServingModels.show_available_models``) and SGLang (``http_server.available_models``) answer
the same shape: one model card per served base model, and one per registered LoRA adapter with ``id`` =
the name requests use, ``root`` = the path it was loaded from, and ``parent`` = its base model. Cards
without a ``parent`` are base models. The read is bounded as a whole (``engine_http.exchange``: one deadline
for the whole reply, a size, no redirects) and its JSON in depth; an engine that answers something else gets a
named ``PeerUnavailable``, never a traceback. Every card is read; a list this node cannot take whole (over
``MAX_REPLY_BYTES``, or more than ``MAX_CARDS`` adapter cards) comes back ``cut``, saying why, and its reader
holds every exported adapter rather than act on part of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from adapter_fabric.errors import InvalidArgument, PeerUnavailable
from adapter_fabric.integrations.engine_http import exchange

#: largest /v1/models reply read: ~200 bytes a card, so room for tens of thousands of adapters (a larger one is cut)
MAX_REPLY_BYTES = 16 << 20
#: most adapter cards taken from one reply (base-model cards are not counted): a list with more is cut
MAX_CARDS = 100_000
#: longest engine URL accepted (a flag or variable names it)
MAX_URL_CHARS = 2048
#: seconds one read of an engine takes at most, whole (connect, TLS, headers, body)
READ_DEADLINE_S = 5.0


@dataclass(frozen=True)
class EngineLoRA:
    """One LoRA adapter an engine has registered: the name requests use and the path it loaded from."""

    name: str
    root: str


@dataclass(frozen=True)
class EngineList:
    """What one GET /v1/models answered: its adapter cards, and why that is not all of them ("" when it is)."""

    adapters: tuple[EngineLoRA, ...]
    cut: str = ""


def check_engine_url(url: str) -> str:
    """``url`` without a trailing slash; InvalidArgument naming the problem unless it is an http(s) URL of a host."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidArgument(f"engine URL is {len(url)} characters long; at most {MAX_URL_CHARS}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"engine URL {url[:200]!r} is not an http:// or https:// URL naming a host (e.g. http://127.0.0.1:8000)")
    if parts.query or parts.fragment:
        raise InvalidArgument(f"engine URL {url[:200]!r} has a query or fragment; give the server's base URL")
    return url.rstrip("/")


def engine_label(url: str) -> str:
    """A short, bounded name of an engine for metrics and listings: its host:port."""
    parts = urlsplit(url)
    return parts.netloc[:100] or url[:100]


def read_models(url: str, timeout: float = READ_DEADLINE_S, headers: dict[str, str] | None = None) -> EngineList:
    """The LoRA adapters the engine at ``url`` lists in ``GET /v1/models``, all within ``timeout`` seconds; PeerUnavailable
    when it does not answer so."""
    label = engine_label(url)
    body = exchange(f"{url}/v1/models", "GET /v1/models", label, timeout, MAX_REPLY_BYTES, headers={"Accept": "application/json", **(headers or {})})
    if len(body) > MAX_REPLY_BYTES:
        return EngineList((), cut=f"its GET /v1/models reply is over {MAX_REPLY_BYTES} bytes (not read)")
    return parse_models(body, label)


def json_reply(body: bytes, label: str, what: str) -> Any:
    """``body`` parsed as JSON; PeerUnavailable naming the engine when it is not, or nests deeper than the interpreter recurses
    (json's decoder stops there with RecursionError: the bound on depth, about 1,000 levels)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, an integer of too many digits
        raise PeerUnavailable(f"engine {label} answered {what} with no JSON this node reads ({type(exc).__name__}: {str(exc)[:100]})") from None


def parse_models(body: bytes, label: str) -> EngineList:
    """The adapter cards (those with a ``parent``) of a /v1/models reply, every one of them up to MAX_CARDS (more: cut);
    PeerUnavailable naming what is wrong with it."""
    answer = json_reply(body, label, "GET /v1/models")
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list):
        raise PeerUnavailable(f"engine {label} answered GET /v1/models with no OpenAI model list (no \"data\" list)")
    found: list[EngineLoRA] = []
    for card in cards:
        if not isinstance(card, dict) or not card.get("parent"):
            continue  # a base model (or something this reader does not know)
        name, root = card.get("id"), card.get("root")
        if isinstance(name, str) and isinstance(root, str):
            if len(found) == MAX_CARDS:
                return EngineList(tuple(found), cut=f"it lists more than {MAX_CARDS} adapters (the rest not read)")
            found.append(EngineLoRA(name=name, root=root))
    return EngineList(tuple(found))
