"""The plain records of the slot pool: a slot's metadata and what callers read of it, a staged row, a module's place in a row."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapter_fabric.errors import InvalidArgument


@dataclass
class SlotMeta:
    name: str | None = None
    content_id: int = 0
    ref_count: int = 0
    pinned: bool = False
    last_used: int = 0
    generation: int = 0
    #: largest rank of any module of the tenant (0 when empty)
    rank: int = 0
    #: the store digest of the adapter it holds ("" when it came from a directory, or the slot is empty)
    digest: str = ""


@dataclass(frozen=True)
class SlotInfo:
    """One slot as callers see it: who holds it, its content id, refs, pin, rank, LRU time and the digest it came from."""

    slot: int
    name: str | None
    content_id: int
    ref_count: int
    pinned: bool
    active: bool
    last_used: int
    rank: int
    generation: int
    digest: str = ""


@dataclass
class StagedAdapter:
    """An adapter laid out like one slot row in host memory, checked against the pool."""

    row: torch.Tensor | None  # [slot_numel], pool dtype, pinned on CUDA; None once recycled
    scaling: torch.Tensor | None  # [num_modules], float32
    ranks: dict[str, int]
    rank: int
    nbytes: int = field(default=0)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The row and its scaling; ``InvalidArgument`` once recycled (it can be neither committed nor read again)."""
        if self.row is None or self.scaling is None:
            raise InvalidArgument("this staged adapter's buffers were recycled (committed or abandoned); prepare it again")
        return self.row, self.scaling


@dataclass(frozen=True)
class Span:
    """Where one module's buffers start in a slot row (elements): A ``[max_rank, in]``, then B ``[out, max_rank]``."""

    a_off: int
    b_off: int
    in_features: int
    out_features: int
