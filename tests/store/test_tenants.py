"""Per-tenant quotas in the store itself (issue 21): reserved before bytes arrive, per prefix, released when a writer ends."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from adapter_fabric.access.policy import TenantQuota
from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.manifest import build_manifest
from tests.support.store import blake3_of

SHAPE = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("tenants"), build_tiny_model()
    return {name: make_peft_adapter(root / name, base_model=base, seed=40 + i, **SHAPE) for i, name in enumerate("abcd")}


def sizes(directory: Path) -> tuple[int, int]:
    """(config, weights) bytes: adapters of one shape share their config file, which a tenant holds once."""
    return (directory / "adapter_config.json").stat().st_size, (directory / "adapter_model.safetensors").stat().st_size


def written(store: AdapterStore) -> list[str]:
    """Whatever an upload, a partial or a temp file left in the store."""
    return [p.name for d in (store._layout.uploads, store._layout.partials, store._layout.tmp) for p in d.iterdir()]


def test_a_stage_past_the_tenants_bytes_is_refused_naming_prefix_limit_and_usage(tmp_path, adapters) -> None:
    config, weights = sizes(adapters["a"])
    limit = config + weights * 2 + weights // 2
    store = AdapterStore(tmp_path / "s", tenant_quotas=(TenantQuota("team-a/", max_bytes=limit),))
    store.stage(adapters["a"], "team-a/a")
    store.stage(adapters["b"], "Team-A/b")  # case-blind: the same tenant
    with pytest.raises(QuotaExceeded) as caught:
        store.stage(adapters["c"], "team-a/c")
    message = str(caught.value)
    assert "tenant 'team-a/'" in message and f"{limit} bytes" in message and f"it holds {config + weights * 2}" in message, message
    assert written(store) == [] and sorted(m.adapter_id for m in store.list()) == ["Team-A/b", "team-a/a"]
    store.stage(adapters["c"], "team-b/c")  # another tenant is not limited
    store.stage(adapters["a"], "team-a/a-again")  # the same bytes under a new id of the tenant need no more bytes
    [usage] = store.tenant_usage()
    assert (usage.prefix, usage.bytes, usage.adapters) == ("team-a/", config + weights * 2, 3)


def test_a_stage_past_the_tenants_count_is_refused_but_restaging_an_id_is_not(tmp_path, adapters) -> None:
    store = AdapterStore(tmp_path / "s", tenant_quotas=(TenantQuota("team-a/", max_adapters=2),))
    store.stage(adapters["a"], "team-a/1")
    store.stage(adapters["b"], "team-a/2")
    with pytest.raises(QuotaExceeded, match=r"tenant 'team-a/' is at its limit of 2 adapters \(it holds 2\)"):
        store.stage(adapters["c"], "team-a/3")
    store.stage(adapters["c"], "team-a/2")  # a new version of an id it holds: still two ids
    assert store.get("team-a/2").digest != store.get("team-a/1").digest
    assert [(u.adapters, u.max_adapters) for u in store.tenant_usage()] == [(2, 2)]


def test_nested_prefixes_each_count(tmp_path, adapters) -> None:
    quotas = (TenantQuota("team-a/", max_adapters=3), TenantQuota("team-a/big/", max_adapters=1))
    store = AdapterStore(tmp_path / "s", tenant_quotas=quotas)
    store.stage(adapters["a"], "team-a/big/1")
    with pytest.raises(QuotaExceeded, match="tenant 'team-a/big/'"):
        store.stage(adapters["b"], "team-a/big/2")
    store.stage(adapters["b"], "team-a/small/2")
    store.stage(adapters["c"], "team-a/small/3")
    with pytest.raises(QuotaExceeded, match="tenant 'team-a/' is at its limit of 3"):
        store.stage(adapters["d"], "team-a/small/4")


def test_an_open_upload_holds_its_tenants_room_until_it_ends(tmp_path, adapters) -> None:
    """Two uploads of one tenant opened together cannot pass its limit: the first reserved its declared size."""
    config, weights = sizes(adapters["a"])
    store = AdapterStore(tmp_path / "s", tenant_quotas=(TenantQuota("team-a/", max_bytes=config + weights + weights // 2),))

    def open_upload(name: str, adapter_id: str):
        weights = adapters[name] / "adapter_model.safetensors"
        config = (adapters[name] / "adapter_config.json").read_bytes()
        root = build_manifest(adapter_id, config, weights, store.chunk_size).weights.root  # what a client declares
        return store.open_upload(adapter_id, config, weights.stat().st_size, blake3_of(weights), root), weights.read_bytes()

    first, data = open_upload("a", "team-a/1")
    with pytest.raises(QuotaExceeded, match="tenant 'team-a/'"):
        open_upload("b", "team-a/2")
    assert os.listdir(store._layout.uploads) == [first._directory.name]  # the refused one wrote nothing
    assert store.tenant_usage()[0].adapters == 1  # the open upload counts
    first.discard()  # released on failure: the room is free again
    assert store.tenant_usage()[0].bytes == 0
    second, data = open_upload("b", "team-a/2")
    second.append(0, data)
    second.commit()
    assert [m.adapter_id for m in store.list()] == ["team-a/2"]


def test_quotas_can_be_replaced_without_reopening_the_store(tmp_path, adapters) -> None:
    store = AdapterStore(tmp_path / "s")
    store.stage(adapters["a"], "team-a/1")
    store.set_tenant_quotas((TenantQuota("team-a/", max_adapters=1),))
    with pytest.raises(QuotaExceeded, match="limit of 1 adapters"):
        store.stage(adapters["b"], "team-a/2")
    store.set_tenant_quotas(())
    store.stage(adapters["b"], "team-a/2")


def _open_upload(store: AdapterStore, directory: Path, adapter_id: str):
    weights = directory / "adapter_model.safetensors"
    config = (directory / "adapter_config.json").read_bytes()
    root = build_manifest(adapter_id, config, weights, store.chunk_size).weights.root
    return store.open_upload(adapter_id, config, weights.stat().st_size, blake3_of(weights), root), weights.read_bytes()


def test_bytes_a_tenant_left_count_against_it_until_resumed_or_expired(tmp_path, adapters) -> None:
    """Issue 28 (4): an upload cut short and a partial download kept for a resume count against the tenant that opened
    them, never twice while a writer holds them again, and not at all once they expire."""

    config, weights = sizes(adapters["a"])
    store = AdapterStore(tmp_path / "s", chunk_size=4096, tenant_quotas=(TenantQuota("team-a/", max_bytes=config + weights * 2 + weights // 2),))
    upload, data = _open_upload(store, adapters["a"], "team-a/cut")
    upload.append(0, data[: len(data) - 100])
    upload.close()  # a Stage stream cut short: its bytes stay to resume
    left = sum(p.stat().st_size for p in (store._layout.uploads).rglob("*") if p.is_file())
    assert store.tenant_usage()[0].bytes == left and left >= weights - 100
    other = AdapterStore(tmp_path / "o", chunk_size=4096)
    manifest = other.stage(adapters["b"], "team-a/pulled").with_id("team-a/pulled")
    partial = store.open_partial(manifest)
    partial.write_chunk(0, other.blob_path(manifest.weights.root).read_bytes()[:4096])
    partial.close()  # a pull that failed: its verified chunk stays to resume
    usage = store.tenant_usage()[0].bytes
    assert usage == left + (store._layout.partials / manifest.digest / "data").stat().st_size + (store._layout.partials / manifest.digest / "manifest.json").stat().st_size
    with pytest.raises(QuotaExceeded, match="in uploads and partial downloads it left"):
        store.stage(adapters["c"], "team-a/new")  # fits the quota only if what it left were not counted
    resumed, _ = _open_upload(store, adapters["a"], "team-a/cut")  # resumed: counted once, by its reservation
    assert store.tenant_usage()[0].bytes == usage - left + config + weights
    resumed.close()
    assert written(store) and store.expire_abandoned(1e-9, now=time.time() + 60)
    assert store.tenant_usage()[0].bytes == 0 and written(store) == []
    store.stage(adapters["c"], "team-a/new")


def test_a_tenants_usage_is_kept_between_writers_and_read_whole_again_after_another_process_changes_a_ref(
    tmp_path, adapters, monkeypatch
) -> None:
    """Every writer of a tenant with a quota asks for its usage; at 100,000 ids reading it whole took ~0.1 s (and a
    manifest per id of the tenant). It is read whole once, kept in step with this store's commits, and read whole again
    only after another process changed a ref: each answer the same as a whole read's."""
    from adapter_fabric.store.tenant_holdings import TenantHoldings

    root = tmp_path / "s"
    quotas = (TenantQuota("team-a/", max_bytes=10**9), TenantQuota("team-b/", max_adapters=100), TenantQuota("team-a/deep/"))
    store = AdapterStore(root, tenant_quotas=quotas)
    takes = []
    take = TenantHoldings._take
    monkeypatch.setattr(TenantHoldings, "_take", lambda self, prefixes: takes.append(self) or take(self, prefixes))

    def usage(of: AdapterStore) -> set[tuple[str, int, int]]:
        return {(u.prefix, u.bytes, u.adapters) for u in of.tenant_usage()}

    def whole() -> set[tuple[str, int, int]]:  # a store object with no index kept: it reads everything, every time
        return usage(AdapterStore(root, tenant_quotas=quotas, collect_at_open=False))

    assert usage(store) == {("team-a/", 0, 0), ("team-b/", 0, 0), ("team-a/deep/", 0, 0)}
    for name, adapter_id in (("a", "team-a/x"), ("b", "team-a/y"), ("a", "Team-A/Deep/z"), ("c", "team-b/q"), ("d", "other/o")):
        store.stage(adapters[name], adapter_id)  # each reserves: it asks for its tenant's usage
    config, weights = sizes(adapters["a"])
    assert ("team-a/deep/", config + weights, 1) in usage(store) and usage(store) == whole()
    store.stage(adapters["c"], "team-a/x")  # restaged: its old blobs leave the tenant unless another of its ids names them
    store.unstage("team-a/y")
    assert usage(store) == whole() and ("team-b/", config + sizes(adapters["c"])[1], 1) in usage(store)
    assert [t for t in takes if t is store._tenants._holdings] == [store._tenants._holdings]  # read whole once

    other = AdapterStore(root, tenant_quotas=quotas, collect_at_open=False)  # another process sharing the store
    other.stage(adapters["b"], "team-a/w")
    assert usage(store) == whole() and ("team-a/", config + 3 * weights, 3) in usage(store)  # read whole meanwhile
    store.unstage("team-a/w")  # this store's next removal collects whole: its index, and so the usage, is trusted again
    before = len([t for t in takes if t is store._tenants._holdings])
    assert usage(store) == whole() and usage(store) == whole() and ("team-a/", config + 2 * weights, 2) in usage(store)
    assert len([t for t in takes if t is store._tenants._holdings]) == before + 1


def test_the_prefixes_an_id_is_under_are_found_by_its_segments_as_covers_finds_them() -> None:
    """A whole read of the tenants' holdings asks it of every id: with 1,000 quotas a test per prefix took 13 s at 100,000."""
    from adapter_fabric.store.tenant_holdings import covering
    from adapter_fabric.store.tenants import covers

    quotas = [TenantQuota(p) for p in ("team-a/", "team-a/deep/", "team-ab/", "t/", "x/y/z/")]
    ids = ["team-a/x", "TEAM-A/Deep/z", "team-a/deeper/z", "team-a./x", "team-ab/x", "team-a", "t/1", "T/2/3", "x/y/z/w", "x/y/zz", "x/y"]
    for adapter_id in ids:
        assert sorted(covering(adapter_id, {q.prefix for q in quotas})) == sorted(q.prefix for q in quotas if covers(q, adapter_id)), adapter_id


def test_a_writer_asking_for_its_tenants_usage_reads_no_upload_another_writer_holds(tmp_path, adapters, monkeypatch) -> None:
    """An open upload counts through its writer's reservation, so its directory is not read for the bytes left behind: a
    StageMany holds dozens open while each of its writers asks (147 adapters/s under a quota before, 427 after)."""
    from adapter_fabric.store import hygiene

    store = AdapterStore(tmp_path / "s", tenant_quotas=(TenantQuota("team-a/", max_bytes=10**9),))
    opened = [_open_upload(store, adapters[name], f"team-a/{name}") for name in ("a", "b")]
    held = [upload for upload, _ in opened]
    held[0].append(0, opened[0][1][:4096])
    read = []
    describe = hygiene._describe
    monkeypatch.setattr(hygiene, "_describe", lambda directory, kind: (read.append(directory.name), describe(directory, kind))[1])
    assert store.tenant_usage()[0].adapters == 2 and read == []  # counted through their reservations, not read
    held[0].close()  # no writer holds it now: its bytes are left behind, read and counted as such
    assert store.tenant_usage()[0].adapters == 1 and read == [held[0]._directory.name]
    held[1].discard()
