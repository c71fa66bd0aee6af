"""The slot pool: preallocated device buffers for ``slots`` LoRA adapters.

Layout. One flat device tensor ``storage[slots + 1, slot_numel]``: row ``s``
holds every adapted module's A (``[max_rank, in]``) and B (``[out, max_rank]``)
for slot ``s``, each laid out as PEFT stores it, so staging a full-rank
adapter is two plain copies per module (the forward reads B through a
transposed view, which the GEMMs take as it is); each module's buffers are
strided views into it. The extra last row is the *zero slot* that base-model rows of a mixed
batch gather from. Per-slot per-module scaling lives in ``scaling[modules,
slots + 1]`` (zero in the zero slot and for modules an adapter does not touch).

A swap never allocates device memory: an adapter is first *staged* off any
lock into a host buffer shaped exactly like one slot row (zero padding
included; pinned on CUDA), then *committed* as a single contiguous copy of
that row. Writing the whole row is what zeroes the slot before the adapter
lands (invariant 4): padding and untouched modules are copied as zeros, so no
byte of the previous tenant survives.

Metadata (names, content ids, refcounts, pins, generations, the LRU clock,
the active slot) is guarded by one re-entrant lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from adapter_fabric.errors import AdapterNotFound, InvalidArgument, SlotBusy
from adapter_fabric.serving.host_copy import SINGLE_THREAD_COPY_BYTES, host_copy
from adapter_fabric.serving.names import ACTIVE
from adapter_fabric.serving.policy import SlotView, check_pin_limit, choose_victim
from adapter_fabric.serving.slot_records import SlotInfo, SlotMeta, Span, StagedAdapter
from adapter_fabric.serving.staging import RowLayout, RowStager


class SlotPool:
    """``slots`` adapter slots for the given modules, preallocated at ``max_rank``; adapters are staged into host rows by
    its ``RowStager`` (off every lock) and committed here."""

    def __init__(
        self,
        modules: Mapping[str, tuple[int, int]],
        slots: int,
        max_rank: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if slots < 1:
            raise InvalidArgument(f"slots={slots} must be at least 1")
        if max_rank < 1:
            raise InvalidArgument(f"max_rank={max_rank} must be at least 1")
        if not modules:
            raise InvalidArgument("a slot pool needs at least one adapted module")
        self.slots = slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout = RowLayout.of(modules, max_rank)
        self.modules: tuple[str, ...] = self.layout.modules
        self.module_index = {m: i for i, m in enumerate(self.modules)}
        self.slot_numel = self.layout.slot_numel
        #: lays adapters out as host slot rows before their commit (``adapter_fabric.serving.staging``)
        self.rows = RowStager(self.layout, self.device, dtype)
        self.zero_slot = slots
        self.storage = torch.zeros(slots + 1, self.slot_numel, device=self.device, dtype=dtype)
        self.scaling = torch.zeros(len(self.modules), slots + 1, device=self.device, dtype=dtype)
        self._a = {m: self._view(m, a=True) for m in self.modules}
        self._b = {m: self._view(m, a=False) for m in self.modules}
        self._meta = [SlotMeta() for _ in range(slots)]
        self._names: dict[str, int] = {}
        self._active: int | None = None
        self._clock = 0
        self.lock = threading.RLock()

    # ------------------------------------------------------------ buffers

    def _view(self, module: str, a: bool) -> torch.Tensor:
        span = self.layout.spans[module]
        if a:
            return self.storage[:, span.a_off : span.a_off + self.max_rank * span.in_features].view(self.slots + 1, self.max_rank, span.in_features)
        return self.storage[:, span.b_off : span.b_off + self.max_rank * span.out_features].view(self.slots + 1, span.out_features, self.max_rank)

    def a(self, module: str) -> torch.Tensor:
        """``[slots + 1, max_rank, in]`` view of the module's A buffers."""
        return self._a[module]

    def b(self, module: str) -> torch.Tensor:
        """``[slots + 1, out, max_rank]`` view of the module's B buffers (PEFT's lora_B layout, rank padded)."""
        return self._b[module]

    def bt(self, module: str) -> torch.Tensor:
        """``[slots + 1, max_rank, out]``: B transposed (a strided view of ``b``)."""
        return self._b[module].transpose(1, 2)

    def shape_of(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of an adapted module."""
        return self.layout.shape_of(module)

    # ------------------------------------------------------------ staging (off every lock: ``RowStager``)

    def stage(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scalings: Mapping[str, float]) -> StagedAdapter:
        """Check an adapter against the pool and lay it out as one host slot row (``RowStager.stage``)."""
        return self.rows.stage(pairs, scalings)

    def span(self, module: str) -> Span:
        """Where a module's A and B start in a slot row (elements), and its shape."""
        return self.layout.spans[module]

    def blank_row(self, ranks: Mapping[str, int], scalings: Mapping[str, float]) -> StagedAdapter:
        """A staging row for an adapter of these module ranks, zero wherever it will not write (``RowStager.blank_row``)."""
        return self.rows.blank_row(ranks, scalings)

    def recycle(self, staged: StagedAdapter) -> None:
        """Hand a staged adapter's buffers back for the next ``stage``; it cannot be committed again."""
        self.rows.recycle(staged)

    # ------------------------------------------------------------ commit (quiescent point)

    def commit(
        self,
        staged: StagedAdapter,
        name: str,
        content_id: int,
        *,
        slot: int | None = None,
        make_active: bool = True,
        pin: bool = False,
        digest: str = "",
    ) -> tuple[int, str | None]:
        """Land a staged adapter; return ``(slot, evicted_name or None)``.

        ``pin`` pins it too; the pin limit is checked with the other checks, before any eviction.
        ``digest``: the store digest it came from, kept with the slot ("" for a directory's adapter).

        ``slot=None`` lets the policy choose the victim (promote); a given slot
        is refused if busy or pinned by another adapter (swap). Every check
        happens before a byte moves, so a refusal changes nothing (invariant 3).
        Reloading a resident name in place reports no eviction.
        """
        if not name:
            raise InvalidArgument("an adapter name must be a non-empty string")
        if content_id <= 0 or content_id >= 1 << 64:
            raise InvalidArgument(f"content id {content_id} must be a non-zero u64")
        if staged.row is None:
            raise InvalidArgument(f"adapter {name!r}: its staged buffers were recycled; prepare it again")
        with self.lock:
            current = self._names.get(name)
            if pin and (current is None or not self._meta[current].pinned):
                check_pin_limit(sum(m.pinned for m in self._meta), self.slots)
            if slot is None and current is not None and self._meta[current].content_id == content_id:
                # Same bytes already resident: no copy, just make it current.
                self._touch(current)
                self._meta[current].pinned |= pin
                self._meta[current].digest = digest or self._meta[current].digest
                if make_active:
                    self._active = current
                return current, None
            if slot is None:
                if current is not None and self._meta[current].ref_count == 0:
                    slot = current  # reload in place
                else:
                    slot = choose_victim(self._views())
            else:
                self._check_index(slot)
                meta = self._meta[slot]
                if meta.ref_count > 0:
                    raise SlotBusy(
                        f"slot {slot} holds {meta.ref_count} reference(s) to adapter {meta.name!r} from running "
                        "sequences; it cannot be overwritten until they end"
                    )
                if meta.pinned and meta.name != name:
                    raise SlotBusy(f"slot {slot} holds pinned adapter {meta.name!r}; unpin it first")
            meta = self._meta[slot]
            evicted = meta.name if meta.name is not None and meta.name != name else None
            pinned = pin or (self._meta[current].pinned if current is not None else False)
            self._write(slot, staged)
            # The old tenant leaves; a same-name copy still busy elsewhere is retired (unnamed).
            if evicted is not None:
                del self._names[evicted]
                if self._active == slot:
                    self._active = None
            if current is not None and current != slot:
                old = self._meta[current]
                old.name = None
                old.pinned = False
                old.digest = ""
                if self._active == current:
                    self._active = slot
            meta.name = name
            meta.content_id = content_id
            meta.pinned = pinned
            meta.rank = staged.rank
            meta.digest = digest
            meta.generation += 1
            self._names[name] = slot
            self._touch(slot)  # invariant 6: the promoted slot is the most recently used
            if make_active:
                self._active = slot
            return slot, evicted

    def _write(self, slot: int, staged: StagedAdapter) -> None:
        row, scaling = staged.buffers()
        try:
            if self.device.type == "cpu" and staged.nbytes < SINGLE_THREAD_COPY_BYTES:
                host_copy(self.storage[slot], row)  # one thread: no wait for torch's intra-op pool
            else:
                self.storage[slot].copy_(row, non_blocking=True)
            self.scaling[:, slot].copy_(scaling, non_blocking=True)
            if self.device.type == "cuda":
                # The slot is marked ready only once the bytes are on the device.
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            # Only a device failure can land here (shapes were checked in stage):
            # never leave half an adapter under a name.
            self._clear(slot)
            raise

    def _clear(self, slot: int) -> None:
        meta = self._meta[slot]
        if meta.name is not None:
            self._names.pop(meta.name, None)
        if self._active == slot:
            self._active = None
        self.storage[slot].zero_()
        self.scaling[:, slot].zero_()
        meta.name, meta.content_id, meta.rank, meta.pinned, meta.digest = None, 0, 0, False, ""
        meta.generation += 1

    # ------------------------------------------------------------ sequences

    def acquire(self, slot: int) -> int:
        """Take a ref on ``slot`` (``-1``: the active one); the resolved slot, or -1 if no ref was taken."""
        with self.lock:
            if slot == ACTIVE:
                if self._active is None:
                    return ACTIVE
                slot = self._active
            self._check_index(slot)
            meta = self._meta[slot]
            if meta.name is None:
                # Never filled, or retired by a same-name reload: no new sequence may start on it.
                raise AdapterNotFound(f"slot {slot} holds no adapter")
            meta.ref_count += 1
            self._touch(slot)
            return slot

    def acquire_name(self, name: str) -> int:
        """Take a ref on the slot holding ``name`` (``AdapterNotFound`` when it is not resident)."""
        with self.lock:
            return self.acquire(self.slot_of(name))

    def release(self, resolved: int) -> None:
        """Drop a ref taken by ``acquire``/``acquire_name``."""
        if resolved == ACTIVE:
            return
        with self.lock:
            self._check_index(resolved)
            meta = self._meta[resolved]
            if meta.ref_count <= 0:
                raise InvalidArgument(f"slot {resolved} has no reference to release")
            meta.ref_count -= 1

    # ------------------------------------------------------------ names, pins, ids

    def slot_of(self, name: str) -> int:
        """The slot holding ``name`` (``AdapterNotFound`` when it is not resident)."""
        with self.lock:
            slot = self._names.get(name)
            if slot is None:
                raise AdapterNotFound(f"adapter {name!r} is not resident (resident: {sorted(self._names)})")
            return slot

    def set_active(self, name: str | None) -> None:
        """Make ``name`` the active adapter (``None``: no active adapter)."""
        with self.lock:
            self._active = None if name is None else self.slot_of(name)

    @property
    def active_slot(self) -> int | None:
        """The active adapter's slot, or None."""
        return self._active

    def pin(self, name: str, pinned: bool) -> None:
        """Pin (or unpin) a resident adapter against eviction; at most ``slots - 1`` may be pinned."""
        with self.lock:
            meta = self._meta[self.slot_of(name)]
            if pinned and not meta.pinned:
                check_pin_limit(sum(m.pinned for m in self._meta), self.slots)
            meta.pinned = pinned

    def resolve(self, slot: int) -> int | None:
        """``-1`` -> the active slot (None if there is none); a slot index is checked and returned."""
        with self.lock:
            if slot == ACTIVE:
                return self._active
            self._check_index(slot)
            return slot

    def adapter_id_for(self, slot: int) -> int:
        """The content id of a slot (``ACTIVE`` resolves the active one; 0 = empty or base)."""
        with self.lock:
            resolved = self.resolve(slot)
            return 0 if resolved is None else self._meta[resolved].content_id

    def rank_of(self, slot: int) -> int:
        """The largest rank of a slot's tenant (0 when empty)."""
        return self._meta[slot].rank

    def touch(self, slots: set[int]) -> None:
        """Mark slots as used now (the LRU clock)."""
        with self.lock:
            for s in sorted(slots):
                self._touch(s)

    def info(self) -> list[SlotInfo]:
        """Every slot, in order: name, content id, refs, pin, active, last use, rank, generation and digest."""
        with self.lock:
            return [
                SlotInfo(i, m.name, m.content_id, m.ref_count, m.pinned, self._active == i, m.last_used, m.rank, m.generation, m.digest)
                for i, m in enumerate(self._meta)
            ]

    def resident_digests(self) -> set[str]:
        """The store digests of the adapters resident in a slot (an evicting store never drops them)."""
        with self.lock:
            return {m.digest for m in self._meta if m.name is not None and m.digest}

    # ------------------------------------------------------------ helpers

    def _views(self) -> list[SlotView]:
        return [SlotView(i, m.name is not None, m.ref_count, m.pinned, m.last_used) for i, m in enumerate(self._meta)]

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._meta[slot].last_used = self._clock

    def _check_index(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise InvalidArgument(f"slot {slot!r} is out of range: the pool has slots 0..{self.slots - 1} (and -1 = active)")
