"""Victim choice as pure policy: no device, no model, no lock."""

from __future__ import annotations

import pytest

from adapter_fabric.errors import PoolFull, QuotaExceeded
from adapter_fabric.serving.policy import SlotView, check_pin_limit, choose_victim


def view(index: int, holds: bool = True, refs: int = 0, pinned: bool = False, last_used: int = 0) -> SlotView:
    return SlotView(index, holds, refs, pinned, last_used)


def test_never_filled_slot_comes_first_even_if_others_are_older() -> None:
    slots = [view(0, last_used=1), view(1, holds=False, last_used=0), view(2, holds=False)]
    assert choose_victim(slots) == 1


def test_least_recently_used_idle_unpinned_slot_is_chosen() -> None:
    slots = [view(0, last_used=5), view(1, last_used=2), view(2, last_used=9)]
    assert choose_victim(slots) == 1


def test_busy_slot_is_never_chosen_even_when_least_recently_used() -> None:
    slots = [view(0, refs=1, last_used=1), view(1, last_used=7), view(2, last_used=3)]
    assert choose_victim(slots) == 2


def test_busy_empty_slot_is_not_chosen() -> None:
    # A retired slot (no name) that a running sequence still reads.
    slots = [view(0, holds=False, refs=2), view(1, last_used=4)]
    assert choose_victim(slots) == 1


def test_pinned_slot_is_skipped() -> None:
    slots = [view(0, pinned=True, last_used=1), view(1, last_used=8)]
    assert choose_victim(slots) == 1


def test_every_slot_busy_or_pinned_raises_pool_full_naming_the_counts() -> None:
    slots = [view(0, refs=1), view(1, pinned=True), view(2, refs=3)]
    with pytest.raises(PoolFull, match=r"3 slots, 2 busy .* 1 idle but pinned"):
        choose_victim(slots)
    assert PoolFull.retryable


def test_excluded_slots_are_not_chosen() -> None:
    slots = [view(0, holds=False), view(1, last_used=1)]
    assert choose_victim(slots, exclude=[0]) == 1


def test_pin_limit_keeps_one_slot_evictable() -> None:
    check_pin_limit(pinned_now=2, slots=4)
    with pytest.raises(QuotaExceeded, match="3 of 4 slots are pinned"):
        check_pin_limit(pinned_now=3, slots=4)
    with pytest.raises(QuotaExceeded):
        check_pin_limit(pinned_now=0, slots=1)
