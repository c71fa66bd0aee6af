"""Driving an SGLang server's LoRA registry from a node's export directory (--sglang-url).

SGLang (0.5.x) loads a PEFT directory only when asked: ``POST /load_lora_adapter`` (``lora_name``,
``lora_path``, ``pinned``) and ``POST /unload_lora_adapter`` (``lora_name``) answer
``{success, error_message, loaded_adapters}`` with 200, or 400 and the reason; ``GET /v1/models`` lists
what it has loaded (``id`` = name, ``root`` = path; read by ``engine_models.read_models``, through the node's one
engine view: ``adapter_fabric.node.engines``).

``plan`` is the pure part: from what the export directory holds and what SGLang lists, the loads and
unloads that bring SGLang in step. Only adapters loaded from inside the export directory are ours to
unload; an adapter SGLang loaded from elsewhere is left alone, and a name it already uses for something
else is not loaded over (``Plan.conflicts``). ``SGLangClient`` is the HTTP part, each call bounded as a whole
in time (``engine_http.exchange``) and in reply size and JSON depth; every failure is a ``FabricError`` naming the engine (``PeerUnavailable`` when it does not answer,
``InvalidArgument`` when it refuses), never a traceback.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

from adapter_fabric.errors import FabricError, InvalidArgument, PeerUnavailable
from adapter_fabric.integrations.engine_http import exchange
from adapter_fabric.integrations.engine_models import EngineList, EngineLoRA, engine_label, json_reply, read_models

#: bound on one whole call (connect, request and the whole reply): SGLang reads the adapter's files before it answers a load
CALL_TIMEOUT_S = 30.0
#: largest load/unload reply read (it lists the loaded adapters' names and paths)
MAX_REPLY_BYTES = 4 << 20
#: characters of an engine's error message kept (it goes into log lines and refusals)
MAX_MESSAGE_CHARS = 300
#: SGLang's answers that mean "already done" (its LoRAManager and LoRARegistry texts, 0.5.x)
ALREADY_LOADED, NOT_LOADED = "already loaded", "does not exist"


@dataclass(frozen=True)
class Plan:
    """What brings SGLang in step: (name, path) to load, names to unload, and held names it uses for another path."""

    loads: tuple[tuple[str, str], ...] = ()
    unloads: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.loads or self.unloads)


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is an entry directly in ``directory`` (both absolute; trailing slashes ignored)."""
    return posixpath.dirname(path.rstrip("/")) == directory.rstrip("/")


def plan(held: Mapping[str, str], loaded: list[EngineLoRA], export_dir: str, changed: frozenset[str] = frozenset()) -> Plan:
    """The loads and unloads that make SGLang hold what ``held`` (export name -> its path) says.

    ``loaded``: what SGLang lists. ``changed``: held names whose bytes changed since they were loaded (re-staged):
    unloaded and loaded again. A card loaded from inside ``export_dir`` whose path is no longer held is unloaded;
    any other card is an operator's and stays, and a held name it uses is a conflict, not a load.
    """
    held_paths = {p.rstrip("/") for p in held.values()}
    by_name = {card.name: card.root.rstrip("/") for card in loaded}
    unloads = [c.name for c in loaded if inside(c.root, export_dir) and c.root.rstrip("/") not in held_paths]
    loads, conflicts = [], []
    for name, path in sorted(held.items()):
        root = by_name.get(name)
        if root is None:
            loads.append((name, path))
        elif root != path.rstrip("/"):
            if not inside(root, export_dir):
                conflicts.append(name)  # an operator's adapter under this name: never unloaded by the node
            elif name in unloads:
                loads.append((name, path))  # ours from a path no longer held: unloaded above, loaded from its path now
        elif name in changed:
            unloads.append(name)
            loads.append((name, path))
    return Plan(tuple(loads), tuple(dict.fromkeys(unloads)), tuple(conflicts))


class SGLangClient:
    """One SGLang server's LoRA routes, bounded; ``label`` (host:port) names it in every error."""

    def __init__(self, url: str, timeout: float = CALL_TIMEOUT_S, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.label = engine_label(url)
        self.timeout = timeout
        self.headers = headers or {}

    def loaded(self) -> EngineList:
        """The adapters SGLang lists in GET /v1/models (PeerUnavailable when it does not answer so)."""
        return read_models(self.url, self.timeout, self.headers)

    def load(self, name: str, path: str) -> bool:
        """Load ``path`` as ``name`` (not pinned: SGLang may swap it out of GPU memory); False when already loaded."""
        ok, message = self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False})
        if ok:
            return True
        if ALREADY_LOADED in message:
            return False
        raise InvalidArgument(f"engine {self.label} refused to load {name!r} from {path[:200]}: {message}")

    def unload(self, name: str) -> bool:
        """Unload ``name``; False when SGLang did not have it."""
        ok, message = self._post("/unload_lora_adapter", {"lora_name": name})
        if ok:
            return True
        if NOT_LOADED in message:
            return False
        raise InvalidArgument(f"engine {self.label} refused to unload {name!r}: {message}")

    def _post(self, route: str, body: dict) -> tuple[bool, str]:
        """(success, error message) of SGLang's answer: 200 or 400 with its JSON; PeerUnavailable for anything else."""
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
        what = f"POST {route}"
        raw = exchange(self.url + route, what, self.label, self.timeout, MAX_REPLY_BYTES, body=json.dumps(body).encode(), headers=headers, accept=(400,))
        if len(raw) > MAX_REPLY_BYTES:
            raise PeerUnavailable(f"engine {self.label} answered {what} with more than {MAX_REPLY_BYTES} bytes")
        answer = json_reply(raw, self.label, what)
        success = answer.get("success") if isinstance(answer, dict) else None
        if not isinstance(success, bool):
            raise PeerUnavailable(f"engine {self.label} answered {what} with no SGLang result (no \"success\" true or false)")
        message = answer.get("error_message")  # a string from SGLang; anything else (a nested list's repr may recurse) is dropped
        return success, (message if isinstance(message, str) else "")[:MAX_MESSAGE_CHARS]


def failure(exc: FabricError) -> str:
    """A bounded one-line text of a failure, for logs and refusals."""
    return " ".join(str(exc).split())[:MAX_MESSAGE_CHARS + 200]
