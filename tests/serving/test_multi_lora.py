"""MultiLoraModel: the ModelAdapters operations, one test per docs/ARCHITECTURE.md invariant, sequences and threads."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_fabric.serving.adapters import ModelAdapters
from adapter_fabric.errors import (
    AdapterNotFound,
    AdaptersUnsupported,
    IncompatibleAdapter,
    InvalidConfig,
    InvalidHeader,
    InvalidTensors,
    PoolFull,
    QuotaExceeded,
    SlotBusy,
)
from adapter_fabric.serving.multi_lora import SAFETENSORS_FILE, MultiLoraModel
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

TOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = build_tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
        "b": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=2),
        "c": dict(r=2, lora_alpha=4, target_modules=["down_proj", "q_proj"], seed=3),
        "d": dict(r=6, lora_alpha=6, target_modules=["o_proj"], use_rslora=True, seed=4),
        "a2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=99),  # "a" retrained
        "big": dict(r=16, lora_alpha=16, target_modules=["q_proj"], seed=5),
    }
    return {name: make_peft_adapter(root / name, base_model=base, **kw) for name, kw in specs.items()}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))


def new_model(slots: int = 2, max_rank: int = 8, **kw) -> MultiLoraModel:
    return MultiLoraModel(build_tiny_model(), slots=slots, max_rank=max_rank, device="cpu", **kw)


def snapshot(model: MultiLoraModel):
    return model.pool.storage.clone(), model.pool.scaling.clone(), model.slots_info()


def assert_unchanged(model: MultiLoraModel, before) -> None:
    storage, scaling, info = before
    assert torch.equal(model.pool.storage, storage), "slot bytes changed"
    assert torch.equal(model.pool.scaling, scaling), "scaling changed"
    assert model.slots_info() == info, "names, ids, refs or clock changed"


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------- the interface


def test_model_without_adapter_support_gives_neutral_reads_and_clear_errors() -> None:
    plain = ModelAdapters()
    assert plain.adapter_id_for(-1) == 0 and plain.adapter_id_for(3) == 0
    assert plain.acquire_adapter_slot(-1) == -1
    assert plain.release_adapter_slot(-1) is None
    for call in (
        lambda: plain.set_active_lora("x"),
        lambda: plain.swap_lora_from_disk("/nowhere", "x", 0),
        lambda: plain.promote_lora_from_disk("/nowhere", "x"),
        lambda: plain.promote_lora_from_peer("127.0.0.1:1", "id", "x", None),
    ):
        with pytest.raises(AdaptersUnsupported, match="has no adapter support"):
            call()


def test_active_adapter_resolves_minus_one_everywhere(dirs, ids) -> None:
    model = new_model()
    assert model.acquire_adapter_slot(-1) == -1 and model.adapter_id_for(-1) == 0
    model.promote_lora_from_disk(dirs["a"], "a")
    model.promote_lora_from_disk(dirs["b"], "b")  # promote makes b active
    assert model.adapter_id_for(-1) == model.adapter_id_for(1)
    model.set_active_lora("a")
    slot = model.acquire_adapter_slot(-1)
    assert slot == 0 and model.slots_info()[0].ref_count == 1
    assert torch.equal(model.forward(ids, [-1, -1]), model.forward(ids, [0, 0]))
    model.release_adapter_slot(slot)
    with pytest.raises(AdapterNotFound, match="'zz' is not resident"):
        model.set_active_lora("zz")


def test_swap_into_a_given_slot_keeps_the_active_adapter(dirs) -> None:
    model = new_model(slots=3)
    model.promote_lora_from_disk(dirs["a"], "a")
    model.swap_lora_from_disk(dirs["c"], "c", 2)
    info = model.slots_info()
    assert info[2].name == "c" and info[0].active and not info[2].active
    model.swap_lora_from_disk(dirs["d"], "d", 0)  # overwrites the active adapter: none is active now
    assert model.adapter_id_for(-1) == 0 and model.slots_info()[0].name == "d"


def test_promote_from_peer_needs_a_fetcher_and_reuses_the_disk_path(dirs, tmp_path) -> None:
    with pytest.raises(AdaptersUnsupported, match="without a fetcher"):
        new_model().promote_lora_from_peer("10.0.0.2:7000", "sha-abc", "a", None)

    fetched: list[tuple[str, str]] = []

    def fetch(peer: str, adapter_id: str, peft) -> Path:
        # A stand-in store: the adapter's bytes land in a local directory first.
        fetched.append((peer, adapter_id))
        return copy_adapter(dirs["a"], tmp_path / adapter_id)

    model = new_model(fetcher=fetch)
    assert model.promote_lora_from_peer("10.0.0.2:7000", "sha-abc", "a", None) == (0, None)
    assert fetched == [("10.0.0.2:7000", "sha-abc")]
    disk = new_model()
    disk.promote_lora_from_disk(dirs["a"], "a")
    assert model.adapter_id_for(0) == disk.adapter_id_for(0) != 0


def test_generate_is_greedy_over_the_adapter(dirs, ids) -> None:
    model = new_model()
    model.promote_lora_from_disk(dirs["b"], "b")
    out = model.generate(ids, "b", 4)
    # The same tokens from full recomputation without a cache.
    seq = ids
    for _ in range(4):
        nxt = model.forward(seq, ["b"] * seq.shape[0])[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)
    assert model.slots_info()[0].ref_count == 0  # the sequence's ref is released
    assert not torch.equal(model.generate(ids, None, 4), out)  # base output differs


# ---------------------------------------------------------------- invariants


def test_invariant_1_busy_slot_is_never_evicted_nor_overwritten(dirs) -> None:
    model = new_model(slots=2)
    model.promote_lora_from_disk(dirs["a"], "a")
    model.promote_lora_from_disk(dirs["b"], "b")
    held = model.acquire("a")  # a is now also the least recently used once b is touched
    model.pool.touch({1})
    a_bytes = model.pool.storage[held].clone()
    assert model.promote_lora_from_disk(dirs["c"], "c") == (1, "b")  # not the busy LRU slot
    before = snapshot(model)
    with pytest.raises(SlotBusy, match="slot 0 holds 1 reference"):
        model.swap_lora_from_disk(dirs["d"], "d", held)
    assert_unchanged(model, before)
    assert torch.equal(model.pool.storage[held], a_bytes)
    model.release(held)


def test_invariant_2_victim_is_never_filled_then_lru_then_pool_full(dirs) -> None:
    model = new_model(slots=2)
    assert model.promote_lora_from_disk(dirs["a"], "a") == (0, None)
    assert model.promote_lora_from_disk(dirs["b"], "b") == (1, None)
    assert model.promote_lora_from_disk(dirs["c"], "c") == (0, "a")
    assert model.promote_lora_from_disk(dirs["a"], "a") == (1, "b")
    model.release(model.acquire("c"))  # c used last: a is the LRU now
    assert model.promote_lora_from_disk(dirs["b"], "b") == (1, "a")
    # Pinning: at most slots - 1, and a pinned slot is skipped.
    model.pin("b", True)
    with pytest.raises(QuotaExceeded, match="1 of 2 slots are pinned"):
        model.pin("c", True)
    assert model.promote_lora_from_disk(dirs["a"], "a") == (0, "c")
    # Every slot busy or pinned: PoolFull, retryable, nothing changed.
    held = model.acquire("a")
    before = snapshot(model)
    with pytest.raises(PoolFull, match="2 slots, 1 busy .* 1 idle but pinned") as err:
        model.promote_lora_from_disk(dirs["d"], "d")
    assert err.value.retryable
    assert_unchanged(model, before)
    model.release(held)


def test_invariant_3_refused_or_failed_swap_leaves_slot_bytes_name_and_id(dirs, tmp_path) -> None:
    model = new_model(slots=2)
    model.promote_lora_from_disk(dirs["a"], "a")
    model.promote_lora_from_disk(dirs["b"], "b")
    truncated = copy_adapter(dirs["c"], tmp_path / "truncated")
    data = (truncated / SAFETENSORS_FILE).read_bytes()
    (truncated / SAFETENSORS_FILE).write_bytes(data[: len(data) - 10])
    nan = copy_adapter(dirs["c"], tmp_path / "nan")
    tensors = load_file(nan / SAFETENSORS_FILE)
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, nan / SAFETENSORS_FILE)
    held = model.acquire("b")
    before = snapshot(model)
    failures = [
        (lambda: model.promote_lora_from_disk(truncated, "c"), InvalidHeader, r"file has \d+ \(10 missing\)"),
        (lambda: model.promote_lora_from_disk(nan, "c"), InvalidTensors, rf"{first}' holds 1 non-finite value"),
        (lambda: model.swap_lora_from_disk(dirs["c"], "c", 1), SlotBusy, "slot 1 holds 1 reference"),
        (lambda: model.swap_lora_from_disk(nan, "a", 0), InvalidTensors, "non-finite"),  # a failed reload of a resident name
    ]
    for call, error, message in failures:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(model, before)
    model.release(held)


def test_invariant_4_slot_is_zeroed_before_a_lower_rank_adapter_lands(dirs, ids) -> None:
    model = new_model(slots=1)
    model.promote_lora_from_disk(dirs["b"], "b")  # rank 8 on all seven modules fills every byte
    assert torch.count_nonzero(model.pool.storage[0]) > 0
    assert model.promote_lora_from_disk(dirs["c"], "c") == (0, "b")  # rank 2 on two modules
    pool = model.pool
    for module in pool.modules:
        rank = 2 if module.endswith(("down_proj", "q_proj")) else 0
        assert torch.count_nonzero(pool.a(module)[0, rank:]) == 0, module
        assert torch.count_nonzero(pool.bt(module)[0, rank:]) == 0, module
        if rank == 0:
            assert pool.scaling[pool.module_index[module], 0].item() == 0.0
    fresh = new_model(slots=1)
    fresh.promote_lora_from_disk(dirs["c"], "c")
    assert torch.equal(model.pool.storage, fresh.pool.storage)
    assert (model.forward(ids, ["c", "c"]) - fresh.forward(ids, ["c", "c"])).abs().max().item() <= TOL


def test_invariant_5_ids_come_from_content(dirs, tmp_path) -> None:
    one, two = new_model(slots=3), new_model(slots=3)
    one.promote_lora_from_disk(dirs["a"], "a")
    two.promote_lora_from_disk(dirs["c"], "c")
    two.promote_lora_from_disk(dirs["a"], "renamed-a")
    id_a = one.adapter_id_for(0)
    assert 0 < id_a < 2**64
    assert two.adapter_id_for(1) == id_a  # same adapter, another pool and name: same id
    # Reloading the name with new contents gives a new id.
    assert one.promote_lora_from_disk(dirs["a2"], "a") == (0, None)
    assert one.adapter_id_for(0) not in (0, id_a)
    # Same tensors, different scaling: a different id too.
    alpha = copy_adapter(dirs["a"], tmp_path / "alpha")
    edit_config(alpha, lora_alpha=32)
    one.promote_lora_from_disk(alpha, "alpha")
    assert len({one.adapter_id_for(s) for s in range(2)} | {id_a}) == 3


def test_invariant_6_promoted_slot_becomes_most_recently_used(dirs) -> None:
    model = new_model(slots=3)
    for name in ("a", "b", "c"):
        model.promote_lora_from_disk(dirs[name], name)
        info = model.slots_info()
        mine = next(i for i in info if i.name == name)
        assert mine.last_used == max(i.last_used for i in info) and mine.active
    model.release(model.acquire("b"))
    model.release(model.acquire("c"))
    model.promote_lora_from_disk(dirs["a"], "a")  # already resident: no copy, but MRU again
    assert model.promote_lora_from_disk(dirs["d"], "d") == (1, "b")


def test_invariant_10_bad_input_is_named_and_changes_no_state(dirs, tmp_path) -> None:
    model = new_model(slots=2, max_rank=8)
    model.promote_lora_from_disk(dirs["a"], "a")
    bad_config = copy_adapter(dirs["c"], tmp_path / "bad_config")
    edit_config(bad_config, use_dora=True)
    narrow = new_model(slots=2, max_rank=8, target_modules=("q_proj", "v_proj"))
    narrow.promote_lora_from_disk(dirs["a"], "a")
    other_arch = copy_adapter(dirs["c"], tmp_path / "other_arch")
    tensors = load_file(other_arch / SAFETENSORS_FILE)
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, other_arch / SAFETENSORS_FILE)
    head = copy_adapter(dirs["a"], tmp_path / "head")  # a module the model has but the pool does not adapt
    edit_config(head, target_modules=["q_proj", "v_proj", "lm_head"])
    tensors = load_file(head / SAFETENSORS_FILE)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)
    save_file(tensors, head / SAFETENSORS_FILE)
    wide = copy_adapter(dirs["c"], tmp_path / "wide")
    tensors = load_file(wide / SAFETENSORS_FILE)
    key = next(k for k in sorted(tensors) if "layers.0.mlp.down_proj.lora_A" in k)
    tensors[key] = torch.zeros(2, 100)
    save_file(tensors, wide / SAFETENSORS_FILE)
    cases = [
        (model, dirs["big"], IncompatibleAdapter, r"q_proj: rank 16 is above the pool's max_rank 8"),
        (model, head, IncompatibleAdapter, r"module lm_head is not held by the slot pool"),
        (narrow, dirs["c"], IncompatibleAdapter, r"module model\.layers\.0\.mlp\.down_proj is not held by the slot pool"),
        (model, other_arch, IncompatibleAdapter, r"module model\.layers\.7\.\S+ does not exist in the model LlamaForCausalLM"),
        (model, wide, IncompatibleAdapter, r"down_proj: the adapter's shape \(in=100, out=64\) differs from the model's linear \(in=128, out=64\)"),
        (model, bad_config, InvalidConfig, r"use_dora=True is not supported"),
        (model, tmp_path / "missing", InvalidConfig, r"adapter_config\.json does not exist"),
    ]
    for target, path, error, message in cases:
        before = snapshot(target)
        with pytest.raises(error, match=message):
            target.promote_lora_from_disk(path, "new")
        assert_unchanged(target, before)


# ---------------------------------------------------------------- concurrency


def test_sequences_never_see_their_adapter_change_while_promotions_run(dirs) -> None:
    names = ["a", "b", "c", "d"]
    model = new_model(slots=3)
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(8))
    expected: dict[str, tuple[int, torch.Tensor]] = {}
    for name in names:
        model.promote_lora_from_disk(dirs[name], name)
        expected[name] = (model.adapter_id_for(model.pool.slot_of(name)), model.forward(prompt, [name]).clone())
    errors: list[str] = []
    done = threading.Event()
    sequences = [0]

    def sequence_worker(offset: int) -> None:
        for i in range(25):
            name = names[(i + offset) % len(names)]
            try:
                slot = model.acquire(name)
            except AdapterNotFound:
                continue  # evicted since: a real server would promote it first
            try:
                want_id, want_logits = expected[name]
                for _ in range(3):  # three "decode steps" of one sequence
                    if model.adapter_id_for(slot) != want_id:
                        errors.append(f"{name}: id changed mid-sequence in slot {slot}")
                    if (model.forward(prompt, [slot]) - want_logits).abs().max().item() > TOL:
                        errors.append(f"{name}: output changed mid-sequence in slot {slot}")
                sequences[0] += 1
            finally:
                model.release(slot)

    def promoter() -> None:
        i = 0
        while not done.is_set() and i < 400:
            try:
                model.promote_lora_from_disk(dirs[names[i % len(names)]], names[i % len(names)])
            except PoolFull:
                pass
            i += 1

    workers = [threading.Thread(target=sequence_worker, args=(k,)) for k in range(3)]
    promoters = [threading.Thread(target=promoter) for _ in range(2)]
    for t in workers + promoters:
        t.start()
    for t in workers:
        t.join()
    done.set()
    for t in promoters:
        t.join()
    assert errors == []
    assert sequences[0] > 0
    assert all(i.ref_count == 0 for i in model.slots_info())
