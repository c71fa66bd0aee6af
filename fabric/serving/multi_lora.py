"""``MultiLoraModel``: a transformers causal LM serving many LoRA adapters from a slot pool.

Every target ``nn.Linear`` of the base model is replaced by a ``LoraLinear``
reading the shared ``SlotPool``; a forward takes one slot per batch row.
Loading (``prepare`` off every lock, ``commit`` at the quiescent point) is
``PoolAdapters``' (``fabric.serving.slot_adapters``); this class adds the model.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import nn

from fabric.serving.device import resolve_device
from fabric.errors import AdapterNotFound, InvalidArgument
from fabric.serving.lora_layers import BASE_ROUTING, LoraLinear, Routing, routed
from fabric.serving.pool import ACTIVE, SlotPool
from fabric.serving.slot_adapters import SAFETENSORS_FILE, Fetcher, PoolAdapters, PreparedAdapter, RowSlot
from fabric.serving.tiny import DEFAULT_TARGET_MODULES, load_base_model

__all__ = ["SAFETENSORS_FILE", "Fetcher", "MultiLoraModel", "PreparedAdapter", "RowSlot"]


class MultiLoraModel(PoolAdapters):
    """A causal LM whose target linears add a per-row LoRA delta from ``slots`` preallocated slots."""

    def __init__(
        self,
        base_model: nn.Module | str,
        slots: int = 4,
        max_rank: int = 16,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        device: str | torch.device = "auto",
        fetcher: Fetcher | None = None,
    ) -> None:
        if isinstance(base_model, str):
            base_model = load_base_model(base_model)
        self.model = base_model.to(resolve_device(device)).eval()
        dtype = next(self.model.parameters()).dtype
        wanted = tuple(target_modules)
        targets = {
            name: (mod.in_features, mod.out_features)
            for name, mod in self.model.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in wanted
        }
        if not targets:
            raise InvalidArgument(
                f"the model {type(self.model).__name__} has no nn.Linear named {', '.join(wanted)}: nothing to adapt"
            )
        pool = SlotPool(targets, slots=slots, max_rank=max_rank, device=resolve_device(device), dtype=dtype)
        super().__init__(
            pool,
            target_modules=target_modules,
            module_names=[name for name, _ in self.model.named_modules()],
            model_label=type(self.model).__name__,
            fetcher=fetcher,
        )
        for name in targets:
            self.model.set_submodule(name, LoraLinear(self.model.get_submodule(name), self.pool, name))

    # ------------------------------------------------------------ compute

    def routing_for(self, slots: Sequence[RowSlot]) -> Routing:
        """Resolve each row's slot (names, -1) once, under the pool lock."""
        pool = self.pool
        with pool.lock:
            resolved: list[int | None] = []
            for row in slots:
                if row is None:
                    resolved.append(None)
                    continue
                slot = pool.slot_of(row) if isinstance(row, str) else pool.resolve(row)
                if slot is not None and pool.adapter_id_for(slot) == 0:
                    raise AdapterNotFound(f"slot {slot} holds no adapter")
                resolved.append(slot)
            used = {s for s in resolved if s is not None}
            pool.touch(used)
            rank = max((pool.rank_of(s) for s in used), default=0)
        if not used:
            return BASE_ROUTING
        if len(used) == 1 and None not in resolved:
            return Routing("single", slot=next(iter(used)), rank=rank)
        rows = torch.tensor([pool.zero_slot if s is None else s for s in resolved], device=self.device)
        return Routing("mixed", rows=rows, rank=rank)

    def forward(
        self, input_ids: torch.Tensor, slots: Sequence[RowSlot], attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; row ``i`` uses ``slots[i]``."""
        if input_ids.dim() != 2 or len(slots) != input_ids.shape[0]:
            raise InvalidArgument(f"forward got {len(slots)} slots for input_ids of shape {tuple(input_ids.shape)}: one per row")
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        routing = self.routing_for(slots)
        with self.lock, torch.inference_mode(), routed(routing):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    __call__ = forward

    def generate(self, input_ids: torch.Tensor, slot_or_name: RowSlot, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with one adapter for every row; holds a ref for the whole sequence."""
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens={max_new_tokens} must be >= 0")
        ids = input_ids.to(self.device)
        resolved = self.acquire(slot_or_name)
        try:
            if max_new_tokens == 0:
                return ids
            routing = self.routing_for([None if resolved == ACTIVE else resolved] * ids.shape[0])
            # transformers 5.x renamed past_key_values to cache; older releases use the old name.
            cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
            past = None
            step = ids
            for _ in range(max_new_tokens):
                # One lock hold per step: commits to other slots land between steps.
                with self.lock, torch.inference_mode(), routed(routing):
                    out = self.model(input_ids=step, use_cache=True, **{cache_arg: past})
                past = out["cache"] if "cache" in out else out["past_key_values"]
                step = out.logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, step], dim=1)
            return ids
        finally:
            self.release(resolved)

