"""Staging, off every lock: an adapter laid out as one host slot row before its commit (``SlotPool``'s first half).

``RowLayout`` says where each module's A and B sit in a slot row; ``RowStager``
(composed by ``SlotPool``, with the pool's layout, device and dtype) lays an
adapter out in a host row shaped exactly like one slot row, zero padding
included, and pinned on CUDA, so the commit at the quiescent point is one
contiguous copy; writing the whole row is what zeroes the slot (invariant 4).
It keeps a few spare rows for reuse behind its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from adapter_fabric.errors import IncompatibleAdapter, InvalidArgument
from adapter_fabric.format.tensor_file import host_array
from adapter_fabric.serving.host_copy import host_copy
from adapter_fabric.serving.slot_records import Span, StagedAdapter

#: host staging rows kept for reuse by ``recycle`` (each is one slot row: 84 MB for Llama-3-8B at r=16)
SPARE_STAGING_ROWS = 2


@dataclass(frozen=True)
class RowLayout:
    """Where every adapted module's A (``[max_rank, in]``) and B (``[out, max_rank]``) start in one slot row (elements)."""

    modules: tuple[str, ...]
    spans: Mapping[str, Span]
    max_rank: int
    slot_numel: int

    @classmethod
    def of(cls, modules: Mapping[str, tuple[int, int]], max_rank: int) -> RowLayout:
        """The layout of ``modules`` (name -> (in, out)) at ``max_rank``: each module's A then its B, in order."""
        spans: dict[str, Span] = {}
        offset = 0
        for name, (fan_in, fan_out) in modules.items():
            if fan_in < 1 or fan_out < 1:
                raise InvalidArgument(f"module {name}: shape (in={fan_in}, out={fan_out}) must be positive")
            spans[name] = Span(offset, offset + max_rank * fan_in, fan_in, fan_out)
            offset += max_rank * (fan_in + fan_out)
        return cls(tuple(modules), spans, max_rank, offset)

    def shape_of(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of an adapted module."""
        span = self.spans[module]
        return span.in_features, span.out_features


class RowStager:
    """``stage``, ``blank_row`` and ``recycle``: host rows laid out as ``layout`` says, in ``dtype``, pinned on a CUDA ``device``."""

    def __init__(self, layout: RowLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.module_index = {m: i for i, m in enumerate(layout.modules)}
        self._spare: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()  # guards _spare

    def stage(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scalings: Mapping[str, float]) -> StagedAdapter:
        """Check an adapter against the pool and lay it out as one host slot row.

        ``pairs`` maps module -> (A ``[r, in]``, B ``[out, r]``) as PEFT stores
        them. Refuses (``IncompatibleAdapter``) a module the pool does not hold,
        a rank above ``max_rank`` and shapes that differ from the pool's.
        """
        if not pairs:
            raise IncompatibleAdapter("the adapter has no LoRA modules: nothing to load")
        for module, (a, b) in pairs.items():
            if module not in self.layout.spans:
                raise IncompatibleAdapter(
                    f"module {module} is not held by the slot pool ({len(self.layout.modules)} adapted modules); "
                    "build the model with it in target_modules"
                )
            fan_in, fan_out = self.layout.shape_of(module)
            if a.dim() != 2 or b.dim() != 2:
                raise IncompatibleAdapter(f"module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must be 2-D")
            rank = a.shape[0]
            if rank > self.layout.max_rank:
                raise IncompatibleAdapter(f"module {module}: rank {rank} is above the pool's max_rank {self.layout.max_rank}")
            if a.shape[1] != fan_in:
                raise IncompatibleAdapter(f"module {module}: lora_A has in_features {a.shape[1]}, the model's linear has {fan_in}")
            if tuple(b.shape) != (fan_out, rank):
                raise IncompatibleAdapter(
                    f"module {module}: lora_B is {tuple(b.shape)}, expected ({fan_out}, {rank}) for out_features "
                    f"{fan_out} and rank {rank}"
                )
            if module not in scalings:
                raise IncompatibleAdapter(f"module {module}: no scaling given")
        staged = self.blank_row({module: a.shape[0] for module, (a, _) in pairs.items()}, scalings)
        row, _ = staged.buffers()
        for module, (a, b) in pairs.items():
            span, rank, max_rank = self.layout.spans[module], a.shape[0], self.layout.max_rank
            host_copy(row[span.a_off : span.a_off + rank * span.in_features].view(rank, span.in_features), a)
            host_copy(row[span.b_off : span.b_off + max_rank * span.out_features].view(span.out_features, max_rank)[:, :rank], b)
        return staged

    def blank_row(self, ranks: Mapping[str, int], scalings: Mapping[str, float]) -> StagedAdapter:
        """A staging row for an adapter of these module ranks, zero wherever it will not write; its scaling set.

        The caller copies each module's A (``[rank, in]``) to the start of its A region and B (``[out, rank]``)
        to the first ``rank`` columns of its B region (``[out, max_rank]``; see ``span``). Zeroing the rest here is the slot's zeroing (invariant 4): untouched modules and
        rank padding hold no byte of a previous tenant once the row is committed.
        """
        row, scaling = self._staging_buffers()
        flat = host_array(row)
        max_rank = self.layout.max_rank
        factors = [0.0] * len(self.layout.modules)  # zero for modules the adapter does not touch
        for module, span in self.layout.spans.items():
            a_end, b_end = span.a_off + max_rank * span.in_features, span.b_off + max_rank * span.out_features
            rank = ranks.get(module, 0)
            if rank == 0:
                flat[span.a_off : b_end] = 0
                continue
            if rank < max_rank:  # rank padding: A's last rows, B's last columns
                flat[span.a_off + rank * span.in_features : a_end] = 0
                flat[span.b_off : b_end].reshape(span.out_features, max_rank)[:, rank:] = 0
            factors[self.module_index[module]] = float(scalings[module])
        scaling.copy_(torch.tensor(factors, dtype=torch.float32))
        used = {m: r for m, r in ranks.items() if r}
        return StagedAdapter(row=row, scaling=scaling, ranks=used, rank=max(used.values()), nbytes=row.numel() * row.element_size())

    def _staging_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A host row and scaling vector to stage into: a recycled pair, or new ones (pinned on CUDA).

        Every byte is overwritten by ``stage``, so a recycled row needs no zeroing first;
        reuse saves the page faults of a fresh slot-sized allocation (and, on CUDA, a pinned one).
        """
        with self._lock:
            if self._spare:
                return self._spare.pop()
        pin = self.device.type == "cuda"
        return (
            torch.empty(self.layout.slot_numel, dtype=self.dtype, pin_memory=pin),
            torch.empty(len(self.layout.modules), dtype=torch.float32, pin_memory=pin),
        )

    def recycle(self, staged: StagedAdapter) -> None:
        """Hand a committed (or abandoned) staged adapter's buffers back for the next ``stage``; it cannot be committed again."""
        if staged.row is None:
            return
        row, scaling = staged.buffers()
        staged.row = staged.scaling = None
        with self._lock:
            if len(self._spare) < SPARE_STAGING_ROWS:
                self._spare.append((row, scaling))
