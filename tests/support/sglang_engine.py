"""An SGLang server on CPU: SGLang 0.5.23's own FastAPI app and LoRA code, over HTTP (scripts/test_sglang installs it).

    python tests/support/sglang_engine.py

Served: ``sglang.srt.entrypoints.http_server.app`` itself (its ``/load_lora_adapter``, ``/unload_lora_adapter``
and ``GET /v1/models`` routes), over SGLang's real ``TokenizerManager`` LoRA methods and ``LoRARegistry``, whose
requests reach a real ``LoRAManager`` that reads each adapter's PEFT files from disk (``LoRAConfig``,
``LoRAAdapter.initialize_weights``) for the fabric's tiny base model. Faked: only what needs the GPU scheduler
process, the scheduler link (``update_lora_adapter_communicator``, a ``FanOutCommunicator`` in SGLang, here a
direct call of the manager, as the scheduler's ``TpModelWorker`` makes) and the GPU memory pool (``memory_pool``).
The hub is offline: a ``lora_path`` that is not a directory is taken as a hub id and refused.
Prints ``engine listening on PORT`` once uvicorn serves on a free port.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the tests package is importable


class CpuPool:
    """Stands in for SGLang's LoRAMemoryPool (GPU buffers): every adapter fits, none holds a slot."""

    def can_support(self, config) -> bool:
        return True

    def remove_lora(self, lora_id: str) -> None:
        return None


def publish_context() -> None:
    """The runtime values SGLang's LoRA code reads (a launched server publishes them from its ServerArgs)."""
    from sglang.srt import runtime_context as rc

    rc.get_parallel().override_permanently(dp_size=1, attn_tp_size=1, attn_dp_enabled=False, attn_cp_size=1, dcp_replicate_q_proj=False)
    class Unset(rc._ConfigBag):
        """A namespace whose leaves not named here read None: SGLang's defaults for the off-by-default options read."""

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return None

    bags = {}
    for path, leaves in {
        "lora": {"enable_lora": True, "max_loaded_loras": None, "enable_lora_overlap_loading": False, "lora_paths": None},
        "model": {"model_checksum": None},  # the weight loader checks files against none
    }.items():
        bags[path] = Unset(path)
        for name, value in leaves.items():
            bags[path]._set(name, value)
    context = rc.get_context()
    context._config_bags = {**(context._config_bags or {}), **bags}
    context._server_args = SimpleNamespace(model_path="tiny")  # read only to ask whether a server was launched


def build_manager():
    """SGLang's LoRAManager for the tiny base model on CPU, its GPU memory pool replaced by CpuPool."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager

    from adapter_fabric.serving.tiny import build_tiny_model

    model = build_tiny_model()
    manager = LoRAManager.__new__(LoRAManager)  # its __init__ builds GPU buffers and swaps the model's layers
    manager.base_model, manager.base_hf_config = model, model.config
    manager.max_loras_per_batch, manager.load_config, manager.dtype = 4, LoadConfig(), torch.float32
    manager.device = torch.device("cpu")
    manager.attn_dp_enabled, manager.attn_tp_size, manager.speculative_algorithm = False, 1, None
    manager.lora_backend, manager.memory_pool = None, CpuPool()
    manager.configs, manager.loras, manager.lora_refs, manager.num_pinned_loras = {}, {}, {}, 0
    manager.pending_lora_load_events = {}
    manager._notify_lora_slots_updated = lambda slots: None
    return manager


def build_app():
    from tests.support.sglang_probe import load_sglang

    load_sglang()  # first: the torchvision stand-in goes on the path the way the probe's comment says
    from sglang.srt.entrypoints import http_server
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    publish_context()
    manager = build_manager()
    tokenizer = TokenizerManager.__new__(TokenizerManager)  # its __init__ starts the scheduler link (ZMQ)
    tokenizer.lora_registry = LoRARegistry()
    tokenizer.lora_update_lock = asyncio.Lock()
    tokenizer.pending_lora_unloads, tokenizer.lora_ref_cache = {}, {}
    tokenizer.served_model_name = "tiny"
    tokenizer.model_config = SimpleNamespace(context_len=128)
    tokenizer.auto_create_handle_loop = lambda: None

    async def scheduler(obj):  # the scheduler's side of the FanOutCommunicator: one rank, this process
        from sglang.srt.lora.lora_registry import LoRARef

        if isinstance(obj, LoadLoRAAdapterReqInput):
            return [manager.load_lora_adapter(LoRARef(lora_id=obj.lora_id, lora_name=obj.lora_name, lora_path=obj.lora_path, pinned=obj.pinned))]
        return [manager.unload_lora_adapter(LoRARef(lora_id=obj.lora_id, lora_name=obj.lora_name))]

    tokenizer.update_lora_adapter_communicator = scheduler
    @http_server.app.get("/test/weights")
    async def weights() -> dict:  # what the LoRAManager read from disk: tensors per loaded adapter name
        return {ref.lora_name: sum(len(layer.weights) for layer in manager.loras[lora_id].layers) for lora_id, ref in manager.lora_refs.items()}

    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tokenizer, template_manager=None, scheduler_info={}))
    return http_server.app


def main() -> None:
    import uvicorn

    app = build_app()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the same port (connections in TIME_WAIT)
    listener.bind(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0))
    listener.listen(128)  # connections queue from here on, before uvicorn takes the socket
    print(f"engine listening on {listener.getsockname()[1]}", flush=True)
    # lifespan off: SGLang's attaches to a launched server's shared memory and scheduler
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    asyncio.run(server.serve(sockets=[listener]))


if __name__ == "__main__":
    main()
