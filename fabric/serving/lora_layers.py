"""``LoraLinear``: an ``nn.Linear`` whose LoRA delta comes from the slot pool, per batch row.

The routing of a forward (which slot each row uses) is set once per forward
in a context variable, not threaded through the model's call signature, so any
transformers architecture works unchanged. Three paths:

* every row base: the plain linear;
* every row the same slot: two small matmuls on that slot's buffers
  (sliced to its rank, so a low-rank adapter does not pay for padding);
* a mix: gather each row's A and B (base rows gather the all-zero slot) and
  ``bmm``; one kernel pair per module whatever the number of adapters, where
  PEFT's ``adapter_names=`` loops over sub-batches. The gathers land in a
  ``GatherScratch`` the model's modules share (one module runs at a time, under
  the model lock): a fresh ``[batch, r, in]`` tensor per module cost its
  allocation and page faults, about three times the copy itself on CPU.

The scaling multiplies the rank-``r`` activations (``B(A(x) * scaling)``, the
small tensor) and the addition is fused into the second GEMM (``addmm_`` /
``baddbmm_``), so no ``[tokens, out]`` temporary is made; fp32 results stay
within rounding (~1e-7) of PEFT's ``B(A(x)) * scaling``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from adapter_fabric.serving.pool import SlotPool


@dataclass(frozen=True)
class Routing:
    """Which slot each batch row reads, for one forward."""

    #: "base" (no LoRA), "single" (all rows one slot) or "mixed"
    kind: str
    #: the slot of a "single" routing
    slot: int = 0
    #: ``[batch]`` slot per row on the pool's device (base rows -> the zero slot), for "mixed"
    rows: torch.Tensor | None = None
    #: largest adapter rank among the rows: buffers are sliced to it
    rank: int = 0


BASE_ROUTING = Routing("base")
_ROUTING: contextvars.ContextVar[Routing] = contextvars.ContextVar("fabric_lora_routing", default=BASE_ROUTING)


@contextmanager
def routed(routing: Routing) -> Iterator[None]:
    """Run the wrapped model's forwards under ``routing``."""
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)


class GatherScratch:
    """Reused buffers for a mixed batch's gathered A and B, grown to the largest module and batch seen.

    Shared by every ``LoraLinear`` of one model: its forwards run one at a time (under the model's lock) and
    its modules one after another, so each module's gathers are spent before the next module's overwrite them.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self._device, self._dtype = device, dtype
        self._buffers = [torch.empty(0, device=device, dtype=dtype) for _ in range(2)]

    def take(self, which: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` over buffer ``which`` (0: A, 1: B); its contents are whatever the last user left."""
        numel = 1
        for size in shape:
            numel *= size
        if self._buffers[which].numel() < numel:
            self._buffers[which] = torch.empty(numel, device=self._device, dtype=self._dtype)
        return self._buffers[which][:numel].view(shape)


class LoraLinear(nn.Module):
    """Wraps ``base`` and adds ``B(A(x)) * scaling`` from the pool's slot for each row; ``scratch``: the model's."""

    def __init__(self, base: nn.Linear, pool: SlotPool, module: str, scratch: GatherScratch) -> None:
        super().__init__()
        self.base_layer = base
        self.module_name = module
        self._scratch = scratch
        # Plain attributes (not submodules or buffers): the pool owns the memory.
        self._a = pool.a(module)
        self._b = pool.b(module)  # [slots + 1, out, max_rank]: the GEMMs read it transposed, without a copy
        self._scaling = pool.scaling[pool.module_index[module]]

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        routing = _ROUTING.get()
        if routing.kind == "base" or routing.rank == 0:
            return result
        r = routing.rank
        if not result.is_contiguous():
            result = result.contiguous()  # the fused in-place add below works on a flat view
        if routing.kind == "single":
            s = routing.slot
            # Scale the rank-r activations (the small tensor) and fuse "+ delta" into the GEMM.
            h = (x @ self._a[s, :r].t()) * self._scaling[s]
            return result.view(-1, result.shape[-1]).addmm_(h.view(-1, r), self._b[s, :, :r].t()).view(result.shape)
        rows = routing.rows
        assert rows is not None, "a mixed routing carries its rows"
        batch = rows.shape[0]
        a = torch.index_select(self._a[:, :r], 0, rows, out=self._scratch.take(0, (batch, r, self.in_features)))
        b = torch.index_select(self._b[:, :, :r], 0, rows, out=self._scratch.take(1, (batch, self.out_features, r)))
        scale = self._scaling.index_select(0, rows).view(-1, 1, 1)  # [batch, 1, 1]
        h = torch.bmm(x.reshape(batch, -1, x.shape[-1]), a.transpose(1, 2)) * scale
        return result.view(batch, -1, result.shape[-1]).baddbmm_(h, b.transpose(1, 2)).view(result.shape)
