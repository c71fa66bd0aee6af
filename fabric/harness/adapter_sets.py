"""Many small, distinct, valid PEFT adapters in a store, fast (scripts/bench_cache.py, scripts/bench_metadata.py).

A few adapters are real: PEFT's ``save_pretrained`` over the built-in tiny
model (``adapter_fabric.serving.tiny``). The rest are derived from them: the same
``adapter_config.json`` and the same tensor names, shapes and dtypes, with
fresh seeded random values, written with safetensors. Every one is a valid
LoRA adapter for the tiny model, and no two share bytes (each its own digest).

They go into a store directory in-process, through the store's own API
(``AdapterStore.stage``, each commit durable as a node's), before a node is
started on it: the Stage RPC commits one adapter at a time, far slower.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: adapters one populate call may make (the metadata benchmark's 100,000 with room to spare)
MAX_ADAPTERS = 1_000_000
#: real adapters the derived ones copy their config and shapes from
REAL_COUNT = 4


def adapter_id(index: int) -> str:
    """The id of the ``index``-th adapter of a set (a tenant's adapter, as a multi-tenant cluster names them)."""
    return f"tenant-{index:06d}/lora"


def real_adapters(out: Path, rank: int = 8, targets: Sequence[str] = ("q_proj", "v_proj"), count: int = REAL_COUNT) -> list[Path]:
    """``count`` real PEFT adapters of the tiny model, written by ``save_pretrained`` (seeded, distinct)."""
    from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

    base = build_tiny_model()
    return [make_peft_adapter(out / f"real{i}", base_model=base, r=rank, lora_alpha=2 * rank, target_modules=list(targets), seed=1000 + i) for i in range(count)]


def derive(real: Path, out: Path, seed: int) -> Path:
    """Write into ``out`` an adapter with ``real``'s config and tensor layout, and values of its own from ``seed``."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE

    tensors = load_file(str(real / WEIGHTS_FILE))
    rng = np.random.default_rng(seed)
    fresh = {name: (rng.standard_normal(t.shape) * 0.02).astype(t.dtype) for name, t in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(real / CONFIG_FILE, out / CONFIG_FILE)
    save_file(fresh, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def _stage_range(store_root: str, reals: list[str], start: int, stop: int) -> int:
    """Stage adapters ``start``..``stop - 1`` into the store at ``store_root``; their bytes in all."""
    from adapter_fabric.store.adapter_store import AdapterStore

    store = AdapterStore(store_root)
    total = 0
    with tempfile.TemporaryDirectory(prefix="adapter-set-") as scratch:
        for index in range(start, stop):
            # Index 0..REAL_COUNT-1 are the real adapters themselves; the rest derive from one of them.
            source = Path(reals[index]) if index < len(reals) else derive(Path(reals[index % len(reals)]), Path(scratch), seed=index)
            total += sum(f.size for f in store.stage(source, adapter_id(index)).files)
    return total


def populate(store_root: Path, reals: list[Path], count: int, jobs: int = 1) -> int:
    """Stage ``count`` distinct adapters (``adapter_id(0..count-1)``) into the store at ``store_root``; their bytes in all.

    ``jobs`` processes share the work (the store's flock orders their commits).
    """
    if not 1 <= count <= MAX_ADAPTERS:
        raise ValueError(f"count must be 1 to {MAX_ADAPTERS}, got {count}")
    from adapter_fabric.store.adapter_store import AdapterStore

    AdapterStore(store_root)  # created (and recovered) once, before the workers open it
    step = -(-count // max(1, jobs))
    ranges = [(str(store_root), [str(r) for r in reals], start, min(count, start + step)) for start in range(0, count, step)]
    if len(ranges) == 1:
        return _stage_range(*ranges[0])
    with multiprocessing.get_context("spawn").Pool(len(ranges)) as pool:
        return sum(pool.starmap(_stage_range, ranges))


def write_directories(root: Path, reals: list[Path], count: int) -> int:
    """Write ``count`` distinct adapters as PEFT directories ``root/<adapter_id(i)>/`` (a ``file://`` origin); their bytes."""
    if not 1 <= count <= MAX_ADAPTERS:
        raise ValueError(f"count must be 1 to {MAX_ADAPTERS}, got {count}")
    total = 0
    for index in range(count):
        out = root / adapter_id(index)
        if index < len(reals):
            out.mkdir(parents=True, exist_ok=True)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copyfile(reals[index] / name, out / name)
        else:
            derive(reals[index % len(reals)], out, seed=index)
        total += sum(f.stat().st_size for f in out.iterdir())
    return total
