"""``MultiLoraModel``: a transformers causal LM serving many LoRA adapters from a slot pool.

Every target ``nn.Linear`` of the base model is replaced by a ``LoraLinear``
reading the shared ``SlotPool``; a forward takes one slot per batch row.

Loading an adapter is split in two (DESIGN invariant 7):

* ``prepare`` runs off every lock: read the directory, validate the config,
  the safetensors header and every tensor's module, rank and shape against
  the model and the pool, hash the file, and stage the tensors as one host
  slot row (pinned on CUDA). Any refusal happens here, before a slot is touched.
* ``commit`` runs at the quiescent point under the model lock (no forward is
  running): choose the victim, overwrite the whole slot row (zeroing included),
  set scaling, name and id, make it active and most recently used. It does no
  I/O: a memory copy only.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fabric.adapter_tensors import LoraPair, lora_pairs
from fabric.adapters import ModelAdapters
from fabric.config import PeftAdapterConfig
from fabric.content_id import content_id
from fabric.device import resolve_device
from fabric.errors import AdapterNotFound, AdaptersUnsupported, IncompatibleAdapter, InvalidAdapter, InvalidArgument, InvalidTensors
from fabric.lora_layers import BASE_ROUTING, LoraLinear, Routing, routed
from fabric.pool import ACTIVE, SlotPool, StagedAdapter
from fabric.safetensors_index import parse_header
from fabric.tiny import DEFAULT_TARGET_MODULES, load_base_model

SAFETENSORS_FILE = "adapter_model.safetensors"

#: ``(peer_addr, adapter_id, peft fields or None) -> local adapter directory`` (store first, then swap).
Fetcher = Callable[[str, str, Any], Path]
#: A batch row's slot: an index, -1 for the active adapter, a resident name, or None for the base model.
RowSlot = int | str | None


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, validated and staged off the lock, ready to commit."""

    name: str
    config: PeftAdapterConfig
    sha256: str
    content_id: int
    staged: StagedAdapter
    source: Path


class MultiLoraModel(ModelAdapters):
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
        self.device = resolve_device(device)
        self.model = base_model.to(self.device).eval()
        self.dtype = next(self.model.parameters()).dtype
        self.target_modules = tuple(target_modules)
        self.fetcher = fetcher
        self._module_names = {name for name, _ in self.model.named_modules()}
        targets = {
            name: (mod.in_features, mod.out_features)
            for name, mod in self.model.named_modules()
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in self.target_modules
        }
        if not targets:
            raise InvalidArgument(
                f"the model {type(self.model).__name__} has no nn.Linear named {', '.join(self.target_modules)}: nothing to adapt"
            )
        self.pool = SlotPool(targets, slots=slots, max_rank=max_rank, device=self.device, dtype=self.dtype)
        for name in targets:
            self.model.set_submodule(name, LoraLinear(self.model.get_submodule(name), self.pool, name))
        # Held by each forward step and by each commit: commits land between steps.
        self.lock = threading.RLock()

    # ------------------------------------------------------------ ModelAdapters

    def set_active_lora(self, name: str) -> None:
        self.pool.set_active(name)

    def adapter_id_for(self, slot: int) -> int:
        return self.pool.adapter_id_for(slot)

    def acquire_adapter_slot(self, slot: int) -> int:
        return self.pool.acquire(slot)

    def release_adapter_slot(self, resolved: int) -> None:
        self.pool.release(resolved)

    def swap_lora_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        """Load into the given slot (refused if busy or pinned by another adapter); the active adapter is kept."""
        prepared = self.prepare(adapter_dir, name)
        self.commit(prepared, slot=slot, make_active=False)

    def promote_lora_from_disk(self, adapter_dir: str | Path, name: str) -> tuple[int, str | None]:
        return self.commit(self.prepare(adapter_dir, name))

    def promote_lora_from_peer(self, peer_addr: str, adapter_id: str, name: str, peft: Any) -> tuple[int, str | None]:
        if self.fetcher is None:
            raise AdaptersUnsupported(
                f"promote_lora_from_peer({peer_addr!r}, {adapter_id!r}): this MultiLoraModel was built without a "
                "fetcher, so it cannot pull adapters from peers; pass fetcher= (the node supplies one)"
            )
        adapter_dir = self.fetcher(peer_addr, adapter_id, peft)  # network and store I/O: off the lock
        prepared = self.prepare(adapter_dir, name)
        if peft is not None:
            from fabric.peft_fields import check_agrees

            check_agrees(peft, prepared.config, adapter_id)
        return self.commit(prepared)

    # ------------------------------------------------------------ prepare / commit

    def prepare(self, adapter_dir: str | Path, name: str) -> PreparedAdapter:
        """Read, validate and stage an adapter directory; touches no slot and takes no lock."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"adapter name {name!r} must be a non-empty string")
        adapter_dir = Path(adapter_dir)
        config = PeftAdapterConfig.from_dir(adapter_dir)
        path = adapter_dir / SAFETENSORS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InvalidAdapter(f"{path} does not exist: a PEFT adapter directory holds {SAFETENSORS_FILE}") from None
        # hashlib drops the GIL on large inputs: hash on a second core while the rest is checked and staged.
        digest = _Sha256InBackground(data)
        # Validate the very bytes that are hashed and loaded.
        index = parse_header(data, len(data))
        pairs = lora_pairs(index, config)
        self.check_compatible(pairs)
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(data)
        weights = {module: (tensors[pair.a.name], tensors[pair.b.name]) for module, pair in pairs.items()}
        staged = self.pool.stage(weights, {m: config.scaling_for(m) for m in pairs})
        # One reduction over the staged row: NaN/inf anywhere (or fp32 -> fp16 overflow) makes the sum
        # non-finite. Only then run the exact per-tensor check, which names the tensor.
        if not bool(torch.isfinite(staged.row.sum(dtype=torch.float32))) and not bool(torch.isfinite(staged.row).all()):
            raise InvalidTensors(_non_finite_message(weights, pairs, self.dtype))
        sha = digest.hexdigest()
        return PreparedAdapter(name, config, sha, content_id(sha, config, pairs), staged, adapter_dir)

    def commit(self, prepared: PreparedAdapter, *, slot: int | None = None, make_active: bool = True) -> tuple[int, str | None]:
        """Land a prepared adapter at the quiescent point; ``(slot, evicted_name or None)``."""
        with self.lock:
            return self.pool.commit(prepared.staged, prepared.name, prepared.content_id, slot=slot, make_active=make_active)

    def check_compatible(self, pairs: Mapping[str, LoraPair]) -> None:
        """Refuse, naming the module and numbers, an adapter this model and pool cannot hold.

        Needs only the tensor index, so a node checks a peer's manifest before any byte moves.
        """
        for pair in pairs.values():
            self._check_fits(pair.module, pair.rank, pair.in_features, pair.out_features)

    def _check_fits(self, module: str, rank: int, fan_in: int, fan_out: int) -> None:
        if module not in self.pool.module_index:
            if module not in self._module_names:
                raise IncompatibleAdapter(
                    f"module {module} does not exist in the model {type(self.model).__name__}: the adapter was made "
                    "for another architecture or size"
                )
            raise IncompatibleAdapter(
                f"module {module} is not held by the slot pool (pool target_modules: {', '.join(self.target_modules)})"
            )
        model_in, model_out = self.pool.shape_of(module)
        if (fan_in, fan_out) != (model_in, model_out):
            raise IncompatibleAdapter(
                f"module {module}: the adapter's shape (in={fan_in}, out={fan_out}) differs from the model's "
                f"linear (in={model_in}, out={model_out})"
            )
        if rank > self.pool.max_rank:
            raise IncompatibleAdapter(f"module {module}: rank {rank} is above the pool's max_rank {self.pool.max_rank}")

    # ------------------------------------------------------------ pool state

    def slots_info(self) -> list[dict]:
        return self.pool.info()

    def pin(self, name: str, pinned: bool) -> None:
        self.pool.pin(name, pinned)

    # ------------------------------------------------------------ sequences

    def acquire(self, slot_or_name: RowSlot) -> int:
        """Take a ref for a sequence (at prefill): the resolved slot, or -1 (base model / no active adapter)."""
        if slot_or_name is None:
            return ACTIVE
        if isinstance(slot_or_name, str):
            return self.pool.acquire_name(slot_or_name)
        return self.pool.acquire(slot_or_name)

    def release(self, resolved: int) -> None:
        self.pool.release(resolved)

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


def _non_finite_message(weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], pairs: Mapping[str, Any], dtype: torch.dtype) -> str:
    for module, (a, b) in weights.items():
        for tensor, info in ((a, pairs[module].a), (b, pairs[module].b)):
            bad = int((~torch.isfinite(tensor.to(dtype))).sum())
            if bad:
                return f"module {module}: tensor {info.name!r} holds {bad} non-finite value(s) in {dtype}"
    return "the adapter holds non-finite values"


class _Sha256InBackground:
    """sha256 of immutable bytes, computed on a helper thread; ``hexdigest`` waits for it."""

    def __init__(self, data: bytes) -> None:
        self._result: list[str] = []
        self._thread = threading.Thread(target=lambda: self._result.append(hashlib.sha256(data).hexdigest()), daemon=True)
        self._thread.start()

    def hexdigest(self) -> str:
        self._thread.join()
        return self._result[0]
