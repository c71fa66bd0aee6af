"""The benchmarks' adapter sets (``adapter_fabric.harness.adapter_sets``): derived adapters are valid, distinct and stage."""

from __future__ import annotations

from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.harness.adapter_sets import adapter_id, derive, populate, real_adapters
from adapter_fabric.store import AdapterStore


def test_derived_adapters_are_valid_peft_directories_with_distinct_bytes_and_stage_into_a_store(tmp_path) -> None:
    reals = real_adapters(tmp_path / "real", count=1)
    derived = [derive(reals[0], tmp_path / f"d{seed}", seed) for seed in (1, 2)]
    for directory in derived:
        assert PeftAdapterConfig.from_dir(directory).r == PeftAdapterConfig.from_dir(reals[0]).r
    assert populate(tmp_path / "store", reals, count=3) > 0
    store = AdapterStore(tmp_path / "store")
    held = store.held()
    assert [h.adapter_id for h in held] == [adapter_id(i) for i in range(3)]
    assert len({h.digest for h in held}) == 3  # no two share bytes
