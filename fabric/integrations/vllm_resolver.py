"""A vLLM LoRA resolver backed by a fabric node running beside vLLM (a sidecar with ``--export-dir``).

On a request for an adapter vLLM has not loaded, vLLM asks its resolvers.
This one asks the local node to pull the adapter from whichever peer holds
it (``Locate``, then a stage-only ``Promote``), and hands vLLM the node's
exported PEFT directory for it. Nothing is copied: the export is hard links
into the node's store.

``resolve`` is the whole lookup-and-pull, plain Python, tested here against
real nodes. ``register`` (the ``vllm.general_plugins`` entry point) is the
vLLM glue: it needs vLLM installed (a CUDA build of torch), so it is not run
by this project's tests; it is kept to the few lines below.

Configuration (environment, read by ``register``):
  FABRIC_EXPORT_DIR   the node's --export-dir (required; without it the resolver is not registered)
  FABRIC_NODE         the local node's host:port (default 127.0.0.1:50051)
  FABRIC_TLS_CA, FABRIC_TLS_CERT, FABRIC_TLS_KEY, FABRIC_AUTH_TOKEN_FILE  as for the ``fabric`` command
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from fabric.client.node_client import NodeClient
from fabric.errors import AdapterNotFound, InvalidArgument
from fabric.rpc.security import TlsFiles, read_token
from fabric.store.export import adapter_id_of, export_name
from fabric.store.ids import validate_adapter_id
from fabric.store.manifest import CONFIG_FILE

DEFAULT_NODE = "127.0.0.1:50051"


def _matches(directory: Path, base_model_name: str | None) -> bool:
    """A PEFT LoRA directory for ``base_model_name`` (None: any base), as vLLM's filesystem resolver checks."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if config.get("peft_type") != "LORA":
        return False
    return base_model_name is None or config.get("base_model_name_or_path") == base_model_name


def resolve(
    node_addr: str,
    lora_name: str,
    base_model_name: str | None,
    export_dir: str | Path,
    *,
    tls: TlsFiles | None = None,
    token: str | None = None,
    timeout: float | None = None,
) -> Path | None:
    """The exported directory of adapter ``lora_name``, pulled onto the node at ``node_addr`` first if needed.

    ``lora_name`` is an adapter id (``team-a/support-v3``) or its export name
    (``team-a%2Fsupport-v3``). None when no known peer holds it, or when its
    config is not a LoRA for ``base_model_name``. Other failures (a node
    unreachable) raise the library's errors.
    """
    try:
        adapter_id = validate_adapter_id(adapter_id_of(lora_name))
    except InvalidArgument:
        return None  # not a name the fabric can hold
    directory = Path(export_dir) / export_name(adapter_id)
    if not (directory / CONFIG_FILE).is_file():
        with NodeClient(node_addr, tls=tls, token=token, long_timeout=timeout) as node:
            try:
                holders = node.locate(adapter_id).peers
            except AdapterNotFound:
                return None
            if not holders:
                return None
            # A complete copy first; the swarm fills in from partial holders too.
            seed = sorted(holders, key=lambda p: (not p.complete, -p.verified_chunks))[0]
            node.pull(adapter_id, peer=seed.address)
        if not (directory / CONFIG_FILE).is_file():
            raise InvalidArgument(f"node {node_addr} pulled {adapter_id!r} but {directory} is absent: is the node's --export-dir {export_dir}?")
    return directory if _matches(directory, base_model_name) else None


def lora_int_id(lora_name: str) -> int:
    """A stable positive id for vLLM's LoRARequest (vLLM wants a distinct int per adapter name)."""
    return zlib.crc32(lora_name.encode()) + 1


def settings_from_env() -> dict:
    """resolve()'s connection settings from the same variables as the ``fabric`` command."""
    cert, key, ca = (os.environ.get(f"FABRIC_TLS_{k}") for k in ("CERT", "KEY", "CA"))
    tls = TlsFiles(Path(cert) if cert else None, Path(key) if key else None, Path(ca) if ca else None)
    token_file = os.environ.get("FABRIC_AUTH_TOKEN_FILE")
    return {"tls": tls if tls.enabled else None, "token": read_token(token_file) if token_file else None}


# ---- vLLM glue (needs vLLM; untested here: vLLM requires a CUDA torch build) ----


def register() -> None:  # pragma: no cover - the vllm.general_plugins entry point
    """Register the fabric resolver with vLLM when FABRIC_EXPORT_DIR is set."""
    import asyncio

    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

    export_dir, node = os.environ.get("FABRIC_EXPORT_DIR"), os.environ.get("FABRIC_NODE", DEFAULT_NODE)
    if not export_dir:
        return
    settings = settings_from_env()

    class FabricResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            path = await asyncio.to_thread(resolve, node, lora_name, base_model_name, export_dir, **settings)
            return None if path is None else LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id(lora_name), lora_path=str(path))

    LoRAResolverRegistry.register_resolver("adapter-fabric", FabricResolver())
