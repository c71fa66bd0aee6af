"""What an inference engine has registered: the LoRA adapters its OpenAI ``GET /v1/models`` lists.

vLLM (``OpenAIServingModels.show_available_models``) and SGLang (``http_server.available_models``) answer
the same shape: one model card per served base model, and one per registered LoRA adapter with ``id`` =
the name requests use, ``root`` = the path it was loaded from, and ``parent`` = its base model. Cards
without a ``parent`` are base models. The read is bounded in time, in bytes and in cards: an engine that
answers something else gets a named ``PeerUnavailable``, never a traceback.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from adapter_fabric.errors import InvalidArgument, PeerUnavailable
from adapter_fabric.store.lock_watch import check_no_store_lock

#: largest /v1/models reply read: ~200 bytes a card, so room for tens of thousands of adapters
MAX_REPLY_BYTES = 16 << 20
#: most adapter cards taken from one reply (the rest are ignored, and said so)
MAX_CARDS = 100_000
#: longest engine URL accepted (a flag or variable names it)
MAX_URL_CHARS = 2048


@dataclass(frozen=True)
class EngineLoRA:
    """One LoRA adapter an engine has registered: the name requests use and the path it loaded from."""

    name: str
    root: str


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


def read_models(url: str, timeout: float, headers: dict[str, str] | None = None) -> list[EngineLoRA]:
    """The LoRA adapters the engine at ``url`` lists in ``GET /v1/models``; PeerUnavailable when it does not answer so."""
    request = urllib.request.Request(f"{url}/v1/models", headers={"Accept": "application/json", **(headers or {})})
    return parse_models(engine_reply(request, timeout, engine_label(url), "GET /v1/models", MAX_REPLY_BYTES), engine_label(url))


def engine_reply(request: urllib.request.Request, timeout: float, label: str, what: str, max_bytes: int, accept: tuple[int, ...] = ()) -> bytes:
    """The body of an engine's reply to ``request`` (``what``, e.g. "GET /v1/models", names it), at most ``max_bytes``.

    A 2xx reply, or an HTTP error whose code is in ``accept`` (an engine that answers a refusal with a JSON body),
    returns its body; anything else is ``PeerUnavailable`` naming the engine ``label``: never a traceback.
    """
    check_no_store_lock(f"engine {label}: {what}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 (the operator's own engine URL)
            body = reply.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        if exc.code not in accept:
            raise PeerUnavailable(f"engine {label} answered {what} with HTTP {exc.code}") from None
        body = exc.read(max_bytes + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:  # HTTPException: a reply cut short
        reason = getattr(exc, "reason", None) or exc
        raise PeerUnavailable(f"engine {label} did not answer {what}: {str(reason)[:200]}") from None
    if len(body) > max_bytes:
        raise PeerUnavailable(f"engine {label} answered {what} with more than {max_bytes} bytes")
    return body


def parse_models(body: bytes, label: str) -> list[EngineLoRA]:
    """The adapter cards (those with a ``parent``) of a /v1/models reply; PeerUnavailable naming what is wrong with it."""
    try:
        cards = json.loads(body)["data"]
        if not isinstance(cards, list):
            raise TypeError("data is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise PeerUnavailable(f"engine {label} answered GET /v1/models with no OpenAI model list ({str(exc)[:100]})") from None
    found: list[EngineLoRA] = []
    for card in cards[:MAX_CARDS]:
        if not isinstance(card, dict) or not card.get("parent"):
            continue  # a base model (or something this reader does not know)
        name, root = card.get("id"), card.get("root")
        if isinstance(name, str) and isinstance(root, str):
            found.append(EngineLoRA(name=name, root=root))
    return found
