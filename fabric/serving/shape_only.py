"""``ShapeOnlyModel``: a slot pool and the adapter operations for a model known only by its module shapes.

No base weights: prepare validates adapters against the shape table and
stages them, commit lands them in the pool, exactly as ``MultiLoraModel``
does; there is no forward. Benchmarks use it to load adapters at the shapes
of a model too large for the machine (Llama-3-8B: 224 adapted linears), and a
store-and-pool node could use it to check and hold adapters without a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.serving.device import resolve_device
from adapter_fabric.serving.pool import SlotPool
from adapter_fabric.serving.slot_adapters import Fetcher, PoolAdapters
from adapter_fabric.serving.tiny import DEFAULT_TARGET_MODULES

#: Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 8 KV heads of 128 (k/v out 1024)
LLAMA3_8B = dict(layers=32, hidden=4096, intermediate=14336, kv=1024)


def llama_module_shapes(layers: int, hidden: int, intermediate: int, kv: int) -> dict[str, tuple[int, int]]:
    """``module path -> (in_features, out_features)`` of a Llama's seven projections, as transformers names them."""
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    return {f"model.layers.{i}.{m}": s for i in range(layers) for m, s in shapes.items()}


class ShapeOnlyModel(PoolAdapters):
    """``PoolAdapters`` over a pool built from ``modules`` (path -> (in, out)), keeping those named in ``target_modules``."""

    def __init__(
        self,
        modules: Mapping[str, tuple[int, int]],
        slots: int = 4,
        max_rank: int = 16,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.bfloat16,
        fetcher: Fetcher | None = None,
        label: str = "shape-only model",
    ) -> None:
        wanted = tuple(target_modules)
        targets = {name: shape for name, shape in modules.items() if name.rsplit(".", 1)[-1] in wanted}
        if not targets:
            raise InvalidArgument(f"the shape table has no module named {', '.join(wanted)}: nothing to adapt")
        pool = SlotPool(targets, slots=slots, max_rank=max_rank, device=resolve_device(device), dtype=dtype)
        # Parents count as modules of the model too (a message can tell "not in the pool" from "no such module").
        names = {prefix for name in modules for prefix in _prefixes(name)}
        super().__init__(pool, target_modules=wanted, module_names=names, model_label=label, fetcher=fetcher)

    @classmethod
    def llama3_8b(cls, **kwargs) -> ShapeOnlyModel:
        return cls(llama_module_shapes(**LLAMA3_8B), label="Llama-3-8B (shapes only)", **kwargs)


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
