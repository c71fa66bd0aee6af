"""The slot pool on its own: buffers, staging, commit, refs, pins, ids (no model)."""

from __future__ import annotations

import threading

import pytest
import torch

from adapter_fabric.errors import AdapterNotFound, IncompatibleAdapter, InvalidArgument, PoolFull, QuotaExceeded, SlotBusy
from adapter_fabric.serving.pool import SlotPool

MODULES = {"l0.q": (8, 8), "l0.down": (16, 8), "l1.q": (8, 8)}


def make_pool(slots: int = 2, max_rank: int = 4) -> SlotPool:
    return SlotPool(MODULES, slots=slots, max_rank=max_rank, device="cpu", dtype=torch.float32)


def adapter(rank: int, seed: int, modules=("l0.q", "l0.down", "l1.q")) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(rank, MODULES[m][0], generator=g), torch.randn(MODULES[m][1], rank, generator=g)) for m in modules
    }


def load(pool: SlotPool, name: str, rank: int, seed: int, cid: int, **kw):
    pairs = adapter(rank, seed)
    return pool.commit(pool.stage(pairs, {m: 0.5 for m in pairs}), name, cid, **kw)


def snapshot(pool: SlotPool):
    return pool.storage.clone(), pool.scaling.clone(), pool.info()


def assert_unchanged(pool: SlotPool, before) -> None:
    storage, scaling, info = before
    assert torch.equal(pool.storage, storage)
    assert torch.equal(pool.scaling, scaling)
    assert pool.info() == info


def test_buffers_are_preallocated_views_of_one_storage() -> None:
    pool = make_pool(slots=3, max_rank=4)
    assert pool.storage.shape == (4, 4 * (8 + 8) + 4 * (16 + 8) + 4 * (8 + 8))
    assert pool.a("l0.down").shape == (4, 4, 16)
    assert pool.bt("l0.down").shape == (4, 4, 8)
    assert pool.a("l0.down").data_ptr() >= pool.storage.data_ptr()
    ptr = pool.storage.data_ptr()
    load(pool, "x", 4, 1, 11)
    assert pool.storage.data_ptr() == ptr  # a swap allocates no device memory


def test_commit_writes_a_and_transposed_b_and_scaling() -> None:
    pool = make_pool()
    pairs = adapter(3, 7)
    slot, evicted = pool.commit(pool.stage(pairs, {"l0.q": 2.0, "l0.down": 0.25, "l1.q": 1.0}), "x", 5)
    assert (slot, evicted) == (0, None)
    a, b = pairs["l0.down"]
    assert torch.equal(pool.a("l0.down")[slot, :3], a)
    assert torch.equal(pool.bt("l0.down")[slot, :3], b.t())
    assert pool.scaling[pool.module_index["l0.down"], slot].item() == 0.25
    assert torch.count_nonzero(pool.storage[pool.zero_slot]) == 0


def test_stage_refuses_unknown_module_rank_and_shapes_with_numbers() -> None:
    pool = make_pool(max_rank=4)
    with pytest.raises(IncompatibleAdapter, match=r"module l9\.q is not held"):
        pool.stage({"l9.q": (torch.zeros(2, 8), torch.zeros(8, 2))}, {"l9.q": 1.0})
    with pytest.raises(IncompatibleAdapter, match=r"module l0\.q: rank 5 is above the pool's max_rank 4"):
        pool.stage({"l0.q": (torch.zeros(5, 8), torch.zeros(8, 5))}, {"l0.q": 1.0})
    with pytest.raises(IncompatibleAdapter, match=r"module l0\.down: lora_A has in_features 8, the model's linear has 16"):
        pool.stage({"l0.down": (torch.zeros(2, 8), torch.zeros(8, 2))}, {"l0.down": 1.0})
    with pytest.raises(IncompatibleAdapter, match=r"module l0\.q: lora_B is \(9, 2\), expected \(8, 2\)"):
        pool.stage({"l0.q": (torch.zeros(2, 8), torch.zeros(9, 2))}, {"l0.q": 1.0})


def test_lru_eviction_and_reported_names() -> None:
    pool = make_pool(slots=2)
    assert load(pool, "a", 2, 1, 1) == (0, None)
    assert load(pool, "b", 2, 2, 2) == (1, None)
    assert load(pool, "c", 2, 3, 3) == (0, "a")
    pool.release(pool.acquire_name("c"))  # c used after b: b is now least recently used
    assert load(pool, "d", 2, 4, 4) == (1, "b")
    assert [i.name for i in pool.info()] == ["c", "d"]


def test_busy_slot_is_refused_for_a_given_slot_and_skipped_by_the_policy() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)
    load(pool, "b", 2, 2, 2)
    held = pool.acquire_name("b")
    pool.touch({0})  # b is now least recently used, but busy
    before = snapshot(pool)
    with pytest.raises(SlotBusy, match=r"slot 1 holds 1 reference"):
        load(pool, "c", 2, 3, 3, slot=1)
    assert_unchanged(pool, before)
    assert load(pool, "c", 2, 3, 3) == (0, "a")
    pool.release(held)


def test_all_busy_raises_pool_full_and_changes_nothing() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)
    load(pool, "b", 2, 2, 2)
    refs = [pool.acquire_name("a"), pool.acquire_name("b")]
    before = snapshot(pool)
    with pytest.raises(PoolFull):
        load(pool, "c", 2, 3, 3)
    assert_unchanged(pool, before)
    for r in refs:
        pool.release(r)


def test_pins_protect_from_eviction_and_are_limited() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)
    load(pool, "b", 2, 2, 2)
    pool.pin("a", True)
    with pytest.raises(QuotaExceeded):
        pool.pin("b", True)
    assert load(pool, "c", 2, 3, 3) == (1, "b")
    assert load(pool, "d", 2, 4, 4) == (1, "c")
    with pytest.raises(AdapterNotFound, match="'zz' is not resident"):
        pool.pin("zz", True)


def test_promote_with_pin_past_the_limit_evicts_nothing() -> None:
    """commit(pin=True) checks the pin limit with its other checks: a refusal leaves every slot as it was."""
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1, pin=True)
    load(pool, "b", 2, 2, 2)
    before = snapshot(pool)
    with pytest.raises(QuotaExceeded, match="unpin one first"):
        load(pool, "c", 2, 3, 3, pin=True)
    assert_unchanged(pool, before)
    assert load(pool, "b", 2, 2, 2, pin=False) == (1, None)  # same bytes: no copy, still unpinned
    assert [m.pinned for m in pool.info()] == [True, False]


def test_acquire_release_active_and_ids() -> None:
    pool = make_pool(slots=2)
    assert pool.acquire(-1) == -1 and pool.adapter_id_for(-1) == 0
    load(pool, "a", 2, 1, 77)
    assert pool.adapter_id_for(-1) == 77 and pool.adapter_id_for(1) == 0
    slot = pool.acquire(-1)
    assert slot == 0 and pool.info()[0].ref_count == 1
    pool.release(slot)
    with pytest.raises(InvalidArgument, match="no reference to release"):
        pool.release(slot)
    with pytest.raises(AdapterNotFound, match="slot 1 holds no adapter"):
        pool.acquire(1)
    with pytest.raises(InvalidArgument, match=r"slot 5 is out of range: the pool has slots 0\.\.1"):
        pool.acquire(5)


def test_reload_of_a_busy_name_lands_elsewhere_and_retires_the_old_slot() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)
    held = pool.acquire_name("a")
    old_a = pool.a("l0.q")[held].clone()
    assert load(pool, "a", 2, 9, 2) == (1, None)
    info = pool.info()
    assert info[0].name is None and info[0].content_id == 1 and info[1].name == "a"
    assert torch.equal(pool.a("l0.q")[held], old_a)  # the running sequence keeps its bytes
    pool.release(held)
    assert load(pool, "b", 2, 3, 3) == (0, None)  # the retired slot is reused first


def test_same_content_is_not_copied_again() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)
    gen = pool.info()[0].generation
    assert load(pool, "a", 2, 1, 1) == (0, None)
    assert pool.info()[0].generation == gen


def test_concurrent_acquire_release_keeps_counts_exact() -> None:
    pool = make_pool(slots=2)
    load(pool, "a", 2, 1, 1)

    def worker() -> None:
        for _ in range(500):
            pool.release(pool.acquire_name("a"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.info()[0].ref_count == 0
