#!/usr/bin/env python
"""Slot pool and multi-LoRA model benchmark: three comparisons, side by side in one run.

1. Swap: the blocking part of a swap (``SlotPool.commit``: victim choice,
   zeroing + copy of one slot row, scaling, metadata) vs a plain tensor copy of
   the same bytes on the same device. Llama-3-8B shapes (32 layers, hidden
   4096, intermediate 14336, kv dim 1024), rank 16, all seven projections; no
   model weights are needed.
2. Load: ``promote_lora_from_disk`` vs PEFT's ``PeftModel.load_adapter`` for
   the same adapter file and the same model (a medium Llama built in code).
3. Forward: a mixed batch of 8 adapters vs one adapter for every row vs the
   base model vs PEFT's mixed-batch forward (``adapter_names=``).

Prints median times and ratios. Usage: ``python scripts/bench_pool.py [--device auto|cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass
import time
from pathlib import Path
from typing import Callable

import torch

from adapter_fabric.serving.device import resolve_device, synchronize
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.pool import SlotPool
from adapter_fabric.serving.shape_only import LLAMA3_8B, llama_module_shapes
from adapter_fabric.serving.tiny import DEFAULT_TARGET_MODULES, build_tiny_model, make_peft_adapter



Case = tuple[Callable[[], object], Callable[[], object] | None]


@dataclass(frozen=True)
class Timing:
    median: float
    min: float


def timed(cases: dict[str, Case], device: torch.device, reps: int) -> dict[str, Timing]:
    """Median and minimum seconds per case over ``reps`` rounds after a warm-up round.

    Cases run round-robin (one of each per round) so that load from other
    processes on a shared machine hits every case alike. A case's ``setup``
    runs untimed before it.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(reps + 1):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: Timing(statistics.median(values), min(values)) for name, values in samples.items()}


# ---------------------------------------------------------------- 1. swap


def bench_swap(device: torch.device, dtype: torch.dtype, reps: int) -> list[tuple]:
    modules = llama_module_shapes(**LLAMA3_8B)
    rank = 16
    pool = SlotPool(modules, slots=2, max_rank=rank, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    pairs = {
        m: (torch.randn(rank, i, generator=g, dtype=torch.float32).to(dtype), torch.randn(o, rank, generator=g, dtype=torch.float32).to(dtype))
        for m, (i, o) in modules.items()
    }
    start = time.perf_counter()
    staged = pool.stage(pairs, {m: 2.0 for m in modules})
    stage_s = time.perf_counter() - start
    counter = iter(range(1, 10**9))

    def commit() -> None:
        n = next(counter)
        pool.commit(staged, f"adapter-{n % 3}", n)  # a new id every time: always a full copy, always an eviction

    src = staged.row  # the same bytes (pinned on CUDA), copied into a plain device tensor
    dst = torch.empty_like(src, device=device)
    t = timed({"swap": (commit, None), "copy": (lambda: dst.copy_(src, non_blocking=True), None)}, device, reps)
    swap_s, copy_s = t["swap"], t["copy"]
    gb = staged.nbytes / 1e9
    print(f"  swap: {len(modules)} modules, {gb * 1e3:.1f} MB per slot row, pool {pool.storage.numel() * pool.storage.element_size() / 1e9:.2f} GB, staging off-lock {stage_s * 1e3:.0f} ms")
    return [
        ("swap: commit (blocking part)", swap_s, copy_s, "<= 2x plain copy", lambda r: r <= 2.0),
        ("swap: plain tensor copy, same bytes", copy_s, copy_s, "", None),
    ]


# ---------------------------------------------------------------- 2 and 3: a medium model


def medium_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def bench_load(workdir: Path, label: str, build: Callable[[], torch.nn.Module], device: torch.device, reps: int) -> list[tuple]:
    from peft import PeftModel

    adapter = make_peft_adapter(workdir / f"load-{label}", base_model=build(), r=16, lora_alpha=32, target_modules=list(DEFAULT_TARGET_MODULES), seed=1)
    model = MultiLoraModel(build(), slots=2, max_rank=16, device=device)
    names = iter(range(10**9))

    peft = PeftModel.from_pretrained(build().to(device), adapter, adapter_name="first").eval()
    counter = iter(range(10**9))
    current: list[str] = []

    def clean() -> None:
        if current:
            peft.delete_adapter(current.pop())

    def load() -> None:
        name = f"x{next(counter)}"
        peft.load_adapter(adapter, adapter_name=name)
        current.append(name)

    t = timed(
        {"ours": (lambda: model.promote_lora_from_disk(adapter, f"p{next(names) % 3}"), None), "peft": (load, clean)},
        device,
        reps,
    )
    ours_s, peft_s = t["ours"], t["peft"]
    size = (adapter / "adapter_model.safetensors").stat().st_size
    print(f"  load ({label}): adapter r=16 on 7 modules, {size / 1e6:.2f} MB file")
    return [
        (f"load ({label}): promote_lora_from_disk", ours_s, peft_s, ">= 10x faster (ratio <= 0.1)", lambda r: r <= 0.1),
        (f"load ({label}): PEFT load_adapter", peft_s, peft_s, "", None),
    ]


def bench_forward(workdir: Path, dtype: torch.dtype, device: torch.device, reps: int, batch: int, seq: int) -> list[tuple]:
    from peft import PeftModel

    base = medium_model(dtype).to(device)
    dirs = [
        make_peft_adapter(workdir / f"fwd{i}", base_model=base, r=16, lora_alpha=16 + i, target_modules=list(DEFAULT_TARGET_MODULES), seed=10 + i)
        for i in range(8)
    ]
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    model = MultiLoraModel(medium_model(dtype), slots=8, max_rank=16, device=device)
    for i, d in enumerate(dirs):
        model.promote_lora_from_disk(d, f"a{i}")
    mixed_rows = [f"a{i % 8}" for i in range(batch)]
    peft = PeftModel.from_pretrained(medium_model(dtype).to(device), dirs[0], adapter_name="a0").eval()
    for i, d in enumerate(dirs[1:], start=1):
        peft.load_adapter(d, adapter_name=f"a{i}")

    def plain_base() -> None:
        with torch.inference_mode():
            base(input_ids=ids, use_cache=False)

    def peft_mixed() -> None:
        with torch.inference_mode():
            peft(input_ids=ids, adapter_names=mixed_rows, use_cache=False)

    t = timed(
        {
            "base": (plain_base, None),
            "ours_base": (lambda: model.forward(ids, [None] * batch), None),
            "single": (lambda: model.forward(ids, ["a0"] * batch), None),
            "mixed": (lambda: model.forward(ids, mixed_rows), None),
            "peft_mixed": (peft_mixed, None),
        },
        device,
        reps,
    )
    base_s, wrapped_base_s, single_s, mixed_s, peft_mixed_s = (t[k] for k in ("base", "ours_base", "single", "mixed", "peft_mixed"))
    print(f"  forward: medium Llama, batch {batch} x seq {seq}, r=16 on 7 modules, 8 adapters resident")
    return [
        ("forward: base model (plain transformers)", base_s, base_s, "", None),
        ("forward: ours, all rows base", wrapped_base_s, base_s, "", None),
        ("forward: ours, one adapter for all rows", single_s, base_s, "", None),
        ("forward: ours, mixed batch of 8 adapters", mixed_s, base_s, "<= 1.2x base", lambda r: r <= 1.2),
        ("forward: PEFT mixed batch (adapter_names=)", peft_mixed_s, base_s, "", None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    device = resolve_device(args.device)
    half = torch.bfloat16
    # fp32 for the forward on CPU (bf16 matmuls there are slow and unrepresentative); bf16 on CUDA.
    fwd_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.reps} after a warm-up, "
          f"load average {load:.2f} on {os.cpu_count()} cores at start")
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += bench_swap(device, half, args.reps)
        rows += bench_load(Path(tmp), "tiny", lambda: build_tiny_model(dtype=fwd_dtype), device, args.reps)
        rows += bench_load(Path(tmp), "medium", lambda: medium_model(fwd_dtype), device, args.reps)
        rows += bench_forward(Path(tmp), fwd_dtype, device, args.reps, args.batch, args.seq)
    print()
    print(f"load average at end {os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.2f}; ratio = time / the reference row below it (forward: / plain base model)")
    print(f"{'measurement':44} {'median ms':>10} {'ratio':>7} {'min ms':>9} {'ratio':>7}  goal (on medians)")
    for name, timing, ref, goal, check in rows:
        ratio, min_ratio = timing.median / ref.median, timing.min / ref.min
        verdict = "" if check is None else ("  met" if check(ratio) else "  NOT met")
        print(f"{name:44} {timing.median * 1e3:10.2f} {ratio:7.2f} {timing.min * 1e3:9.2f} {min_ratio:7.2f}  {goal}{verdict}")


if __name__ == "__main__":
    main()
