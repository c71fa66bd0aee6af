"""A vLLM LoRA resolver backed by a fabric node running beside vLLM (a sidecar with ``--export-dir``).

On a request for an adapter vLLM has not loaded, vLLM asks its resolvers.
This one asks the local node for the adapter (a stage-only ``Promote`` with
no peer: the node answers what it holds, revalidated with its origin past
``--origin-ttl``, else pulls it from its peers, else fetches it from its
``--origin`` list) and hands vLLM the node's exported PEFT directory for that
digest (``<id>#<digest prefix>``: one path per digest, so vLLM's prefix cache,
keyed by name and path, never mixes two digests of one id). Nothing is
copied: the export is hard links into the node's store. When the id moves,
the node unloads it from vLLM (``node.engine_retarget``) and the next request
comes here again.

It fails safe inside the engine: vLLM calls resolvers outside any ``try``
(``OpenAIServingModels.resolve_lora``) and does not guard its plugin loader,
so ``register`` never raises (bad settings, or a vLLM without the resolver
interface, are logged and the resolver is not registered) and the resolver
never raises (a fabric error is logged with its type and the answer is None:
vLLM then asks its other resolvers and answers 404, not 500). Every pull has
a deadline, and an adapter for another base model is refused by the node from
its manifest before any byte moves.

Names: vLLM's ``model`` field is the adapter id (``team-a/support-v3``), one
canonical name per adapter; the export directory's escaped name
(``team-a%2Fsupport-v3``) is not resolved, so one directory never becomes two
LoRAs in vLLM.

Base model: an adapter is resolved when its ``base_model_name_or_path`` names the model vLLM
loaded (what vLLM hands resolvers: the model path or hub id given to ``vllm serve``, not
``--served-model-name``) or a name in FABRIC_BASE_MODEL, by ``adapter_fabric.format.base_model``'s
rules (without case; whole, or by the last part: ``meta-llama/Llama-3.1-8B-Instruct`` matches
``/models/Llama-3.1-8B-Instruct``); the node checks it (PromoteRequest.base_model carries the
names). A model mounted under another name (``/models/base``) needs FABRIC_BASE_MODEL.

Logs go to vLLM's own log (the ``vllm.adapter_fabric`` logger, under vLLM's ``vllm`` handler):
why the resolver is not registered, an adapter for another base model, a failed resolve.

Configuration (environment, read by ``register``):
  FABRIC_EXPORT_DIR       the node's --export-dir (required; without it the resolver is not registered)
  FABRIC_BASE_MODEL       more names of the served model, comma-separated (see Base model)
  FABRIC_NODE             the local node's host:port (default 127.0.0.1:50051)
  FABRIC_RESOLVE_TIMEOUT  seconds a resolve (locate and pull) may take, 1 to 3600 (default 120)
  FABRIC_TLS_CA, FABRIC_TLS_CERT, FABRIC_TLS_KEY, FABRIC_AUTH_TOKEN_FILE  as for the ``fabric`` command
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import AdapterNotFound, FabricError, IncompatibleAdapter, InvalidArgument
from adapter_fabric.format.base_model import base_model_matches
from adapter_fabric.rpc.security import TlsFiles, read_token
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import CONFIG_FILE
from adapter_fabric.transport.discovery import split_host_port

DEFAULT_NODE = "127.0.0.1:50051"
#: seconds one resolve (locate, manifest, pull) may take; vLLM holds its per-name lock meanwhile
DEFAULT_RESOLVE_TIMEOUT_S = 120.0
MAX_RESOLVE_TIMEOUT_S = 3600.0
#: the name the resolver registers under in vLLM's LoRAResolverRegistry
RESOLVER_NAME = "adapter-fabric"

#: a child of vLLM's ``vllm`` logger, so its records reach the handler vLLM configures (a ``fabric.*`` logger's did not)
log = logging.getLogger("vllm.adapter_fabric")
#: the plugin's name in vLLM's VLLM_PLUGINS (pyproject.toml's vllm.general_plugins entry point)
PLUGIN_NAME = "fabric_lora_resolver"


def _matches(directory: Path, names: tuple[str, ...] | None) -> bool:
    """A PEFT LoRA directory for a model going by ``names`` (None: any base), by ``adapter_fabric.format.base_model``'s rules."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if config.get("peft_type") != "LORA":
        return False
    base = config.get("base_model_name_or_path")
    return names is None or base_model_matches(base if isinstance(base, str) else None, names)


def resolve(
    node_addr: str,
    lora_name: str,
    base_model_name: str | None,
    export_dir: str | Path,
    *,
    tls: TlsFiles | None = None,
    token: str | None = None,
    timeout: float = DEFAULT_RESOLVE_TIMEOUT_S,
    base_model_aliases: tuple[str, ...] = (),
) -> Path | None:
    """The export directory of the digest adapter id ``lora_name`` names now, brought onto the node at ``node_addr`` first.

    The node finds it (held, revalidated past its --origin-ttl; else its known peers; else its --origin list) and
    keeps it under a name of its digest (``export.version_name``): vLLM keys its prefix cache by a LoRA's name and
    path, so when the id moves to new bytes, the new ones come from a new path and no cached block of the old
    ones is reused. None when ``lora_name`` is not an id, when neither the fabric nor an origin has it, or when it
    is not a LoRA for ``base_model_name`` (checked by the node before any byte moves). Other failures (a node
    unreachable, the ``timeout`` passed) raise the library's errors; the vLLM resolver turns them into None.
    ``base_model_aliases``: more names of the served model (FABRIC_BASE_MODEL).
    """
    names = None if base_model_name is None else tuple(n for n in (base_model_name, *base_model_aliases) if n and "," not in n)
    if "%" in lora_name or "#" in lora_name:
        log.info("not resolving %r: ask for the adapter by its id (an export directory's names are escaped)", lora_name[:200])
        return None
    try:
        adapter_id = validate_adapter_id(lora_name)
    except InvalidArgument:
        return None  # not a name the fabric can hold
    with NodeClient(node_addr, tls=tls, token=token, timeout=timeout, long_timeout=timeout) as node:
        try:
            reply = node.pull(adapter_id, base_model=",".join(names or ()), export_version=True, timeout=timeout)
        except AdapterNotFound as exc:
            log.info("adapter-fabric: not resolving %r: %s", adapter_id, str(exc)[:500])
            return None
        except IncompatibleAdapter as exc:  # another base model: said in vLLM's log with what to set (it was a bare 404)
            log.warning("adapter-fabric: not resolving %r: %s; if that is this model under another name, add it to FABRIC_BASE_MODEL",
                        adapter_id, str(exc)[:500])
            return None
    if not reply.export_name:
        raise InvalidArgument(f"node {node_addr} exports nothing: start it with --export-dir {export_dir}")
    directory = Path(export_dir) / reply.export_name
    if not (directory / CONFIG_FILE).is_file():
        raise InvalidArgument(f"node {node_addr} exported {adapter_id!r} but {directory} is absent: is the node's --export-dir {export_dir}?")
    log.info("resolved %r: digest %s%s", adapter_id, reply.digest[:16], f" (origin {reply.origin} revision {reply.revision[:40]})" if reply.origin else "")
    return directory if _matches(directory, names) else None


def lora_int_id(lora_name: str) -> int:
    """A stable positive id for vLLM's LoRARequest (vLLM wants a distinct int per adapter name)."""
    return zlib.crc32(lora_name.encode()) + 1


def settings_from_env() -> dict:
    """resolve()'s connection settings from the same variables as the ``fabric`` command."""
    paths = {k: os.environ.get(f"FABRIC_TLS_{k}") for k in ("CERT", "KEY", "CA")}
    for kind, path in paths.items():
        if path and not Path(path).is_file():
            raise InvalidArgument(f"FABRIC_TLS_{kind}={path[:200]!r} is not a readable file")
    tls = TlsFiles(*(Path(path) if (path := paths[k]) else None for k in ("CERT", "KEY", "CA")))
    token_file = os.environ.get("FABRIC_AUTH_TOKEN_FILE")
    try:
        token = read_token(token_file) if token_file else None
    except FabricError as exc:
        raise InvalidArgument(f"FABRIC_AUTH_TOKEN_FILE: {exc}") from None
    return {"tls": tls if tls.enabled else None, "token": token}


@dataclass(frozen=True)
class ResolverConfig:
    """What ``register`` reads from the environment, checked before vLLM is touched."""

    export_dir: Path
    node: str
    timeout: float
    connection: dict
    base_model_aliases: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> ResolverConfig | None:
        """The configuration, None when FABRIC_EXPORT_DIR is unset; a bad value raises a FabricError naming it."""
        export_dir = os.environ.get("FABRIC_EXPORT_DIR")
        if not export_dir:
            return None
        if not Path(export_dir).is_dir():
            raise InvalidArgument(f"FABRIC_EXPORT_DIR={export_dir[:200]!r} is not a directory (the node's --export-dir)")
        node = os.environ.get("FABRIC_NODE", DEFAULT_NODE)
        try:
            split_host_port(node)
        except InvalidArgument:
            raise InvalidArgument(f"FABRIC_NODE={node[:200]!r} is not HOST:PORT") from None
        raw = os.environ.get("FABRIC_RESOLVE_TIMEOUT", str(DEFAULT_RESOLVE_TIMEOUT_S))
        try:
            timeout = float(raw)
        except ValueError:
            timeout = math.nan
        if not 1 <= timeout <= MAX_RESOLVE_TIMEOUT_S:  # nan fails too
            raise InvalidArgument(f"FABRIC_RESOLVE_TIMEOUT={raw[:50]!r}: expected seconds from 1 to {MAX_RESOLVE_TIMEOUT_S:g}")
        aliases = tuple(name.strip() for name in os.environ.get("FABRIC_BASE_MODEL", "").split(",") if name.strip())
        return cls(Path(export_dir), node, timeout, settings_from_env(), aliases)


# ---- vLLM glue: run against vLLM's own plugin loader and serving layer by tests/integrations/test_vllm.py ----


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the resolver; never raises (vLLM would not start)."""
    try:
        config = ResolverConfig.from_env()
    except FabricError as exc:
        log.warning("adapter-fabric: the vLLM LoRA resolver is not registered: %s", exc)
        return
    if config is None:
        # A warning where VLLM_PLUGINS asked for this plugin by name; else (every installed plugin loads) a note
        asked = PLUGIN_NAME in os.environ.get("VLLM_PLUGINS", "").split(",")
        (log.warning if asked else log.info)(
            "adapter-fabric: FABRIC_EXPORT_DIR is not set: the vLLM LoRA resolver is not registered "
            "(set it to the fabric node's --export-dir, as vLLM sees it)"
        )
        return
    try:
        from vllm.lora.request import LoRARequest
        from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry
    except ImportError as exc:
        log.warning("adapter-fabric: this vLLM has no LoRA resolver interface (vllm.lora.resolver, from vLLM 0.8.5): %s", exc)
        return

    settled: ResolverConfig = config  # the closure below sees the narrowed type

    class FabricResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            import asyncio

            try:
                path = await asyncio.to_thread(
                    resolve, settled.node, lora_name, base_model_name, settled.export_dir, timeout=settled.timeout,
                    base_model_aliases=settled.base_model_aliases, **settled.connection,
                )
            except Exception as exc:  # noqa: BLE001 (never into vLLM: it would answer 500 and skip the other resolvers)
                log.warning("adapter-fabric: resolving %r failed: %s: %s; answering None", lora_name[:200], type(exc).__name__, str(exc)[:500])
                return None
            return None if path is None else LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id(lora_name), lora_path=str(path))

    try:
        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, FabricResolver())
    except Exception as exc:  # noqa: BLE001 (a registry of another vLLM version: logged, vLLM starts without us)
        log.warning("adapter-fabric: vLLM refused the resolver: %s: %s", type(exc).__name__, exc)
        return
    aliases = f"; base model also named {', '.join(config.base_model_aliases)}" if config.base_model_aliases else ""
    log.info("adapter-fabric: LoRA resolver registered (node %s, export directory %s%s)", config.node, config.export_dir, aliases)
