"""``MultiLoraModel``: a transformers causal LM serving many LoRA adapters from a slot pool.

Every target ``nn.Linear`` of the base model is replaced by a ``LoraLinear``
reading the shared ``SlotPool``; a forward takes one slot per batch row.
Loading (``prepare`` off every lock, ``commit`` at the quiescent point) is
``PoolAdapters``' (``adapter_fabric.serving.slot_adapters``); this class adds the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from adapter_fabric.errors import AdapterNotFound, InvalidArgument
from adapter_fabric.serving.device import resolve_device
from adapter_fabric.serving.lora_layers import BASE_ROUTING, GatherScratch, LoraLinear, Routing, routed
from adapter_fabric.serving.pool import ACTIVE, SlotPool
from adapter_fabric.serving.slot_adapters import SAFETENSORS_FILE, Fetcher, PoolAdapters, PreparedAdapter, RowSlot
from adapter_fabric.serving.tiny import DEFAULT_TARGET_MODULES, load_base_model

__all__ = ["SAFETENSORS_FILE", "Decoding", "Fetcher", "MultiLoraModel", "PreparedAdapter", "RowSlot"]


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
        model = load_base_model(base_model) if isinstance(base_model, str) else base_model
        self.model = model.to(resolve_device(device)).eval()
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
        scratch = GatherScratch(self.pool.device, dtype)  # shared: forwards run one at a time, under self.lock
        for name in targets:
            linear = self.model.get_submodule(name)
            assert isinstance(linear, nn.Linear)  # targets holds nn.Linear modules only
            self.model.set_submodule(name, LoraLinear(linear, self.pool, name, scratch))

    # ------------------------------------------------------------ bounds

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1`` (the input embedding's rows)."""
        return int(self.model.get_input_embeddings().num_embeddings)  # type: ignore[operator]  # transformers' models have it; nn.Module does not say so

    @property
    def max_positions(self) -> int | None:
        """The longest sequence (input plus generated tokens) the model has positions for; None if it names none."""
        value = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    def check_tokens(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int = 0) -> None:
        """Refuse, naming the bound, ids outside the vocabulary or a sequence longer than the model's positions.

        Checked before any model work: an id past the embedding is an ``IndexError`` deep in torch,
        and a sequence past the positions costs time and memory for output the model cannot make.
        """
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids), dtype=torch.int64)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise InvalidArgument(f"token id {bad} is outside the vocabulary: ids run from 0 to {self.vocab_size - 1}")
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens={max_new_tokens} must be >= 0")
        length = ids.shape[-1] if ids.dim() else 1
        limit = self.max_positions
        if limit is not None and length + max_new_tokens > limit:
            raise InvalidArgument(
                f"{length} input tokens + max_new_tokens {max_new_tokens} = {length + max_new_tokens} positions: "
                f"the model has {limit} (max_position_embeddings)"
            )

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
        self.check_tokens(input_ids)
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        routing = self.routing_for(slots)
        with self.lock, torch.inference_mode(), routed(routing):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    __call__ = forward

    def generate(
        self, input_ids: torch.Tensor, slot_or_name: RowSlot, max_new_tokens: int, should_stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Greedy decoding with one adapter for every row; holds a ref for the whole sequence.

        ``should_stop`` is asked between decode steps (a cancelled caller, a passed deadline):
        when it answers True the tokens made so far are returned.
        """
        self.check_tokens(input_ids, max_new_tokens)
        resolved = self.acquire(slot_or_name)
        try:
            decoding = Decoding(self, input_ids, resolved)
            for _ in range(max_new_tokens):
                if should_stop is not None and should_stop():
                    break
                decoding.step()
            return decoding.ids
        finally:
            self.release(resolved)


class Decoding:
    """One greedy sequence decoded step by step, on a slot the caller holds a ref on.

    Each ``step`` is one forward under the model lock, so a caller that runs
    steps as separate jobs lets commits to other slots land between them.
    """

    def __init__(self, model: MultiLoraModel, input_ids: torch.Tensor, resolved: int) -> None:
        self.model = model
        self.ids = input_ids.to(model.device)
        self.routing = model.routing_for([None if resolved == ACTIVE else resolved] * self.ids.shape[0])
        # transformers 5.x renamed past_key_values to cache; older releases use the old name.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
        self._past = None
        self._next = self.ids

    def step(self) -> torch.Tensor:
        """Decode one token per row (one lock hold); the tokens made."""
        model = self.model
        with model.lock, torch.inference_mode(), routed(self.routing):
            out = model.model(input_ids=self._next, use_cache=True, **{self._cache_arg: self._past})
        self._past = out["cache"] if "cache" in out else out["past_key_values"]
        self._next = out.logits[:, -1].argmax(-1, keepdim=True)
        self.ids = torch.cat([self.ids, self._next], dim=1)
        return self._next
