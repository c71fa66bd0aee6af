"""Victim choice for the slot pool, as a pure function over plain data.

Kept apart from the pool so the rule (docs/ARCHITECTURE.md invariant 2) can be tested
without a device, a model or a lock: a never-filled (or retired) idle slot
first, else the least recently used idle unpinned slot, else ``PoolFull``.
A busy slot (ref count > 0) is never a candidate (invariant 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from adapter_fabric.errors import PinLimitReached, PoolFull


@dataclass(frozen=True)
class SlotView:
    """What victim choice needs to know about one slot."""

    index: int
    #: True when a named adapter lives here; False for never-filled or retired slots.
    holds_adapter: bool
    ref_count: int
    pinned: bool
    last_used: int


def choose_victim(slots: Sequence[SlotView], exclude: Iterable[int] = ()) -> int:
    """The index of the slot a new adapter should land in, or ``PoolFull``."""
    excluded = set(exclude)
    idle = [s for s in slots if s.ref_count == 0 and s.index not in excluded]
    empty = [s for s in idle if not s.holds_adapter]
    if empty:
        return min(s.index for s in empty)
    evictable = [s for s in idle if not s.pinned]
    if evictable:
        # Ties on the clock (never the case in the pool) fall to the lowest index.
        return min(evictable, key=lambda s: (s.last_used, s.index)).index
    busy = sum(1 for s in slots if s.ref_count > 0)
    pinned = sum(1 for s in slots if s.pinned and s.ref_count == 0)
    raise PoolFull(
        f"no slot can take a new adapter: {len(slots)} slots, {busy} busy (held by running sequences), "
        f"{pinned} idle but pinned; retry when a sequence ends"
    )


def check_pin_limit(pinned_now: int, slots: int) -> None:
    """At most ``slots - 1`` adapters may be pinned, so one slot always stays evictable."""
    if pinned_now + 1 > slots - 1:
        raise PinLimitReached(
            f"cannot pin another adapter: {pinned_now} of {slots} slots are pinned and at most "
            f"{slots - 1} may be; unpin one first"
        )
