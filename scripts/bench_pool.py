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

Prints median times and ratios. Usage::

    python scripts/bench_pool.py [--device auto|cpu|cuda] [--sections swap,load,forward]
    python scripts/bench_pool.py --baseline REV --rounds 3      # before/after: REV's package and this tree's, in turn

With ``--baseline``, each round runs this script twice in child processes, first
importing the package of git revision ``REV`` (``adapter_fabric.harness.baseline``),
then this tree's; each child times its own reference rows (PEFT, the plain copy,
the base model) beside ours, so every ratio is from one process and the two
trees' ratios are compared round by round (medians over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.harness.flag_bounds import refuse_out_of_range
from adapter_fabric.serving.device import DEVICE_CHOICES, resolve_device, synchronize
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.pool import SlotPool
from adapter_fabric.serving.shape_only import LLAMA3_8B, llama_module_shapes
from adapter_fabric.serving.tiny import DEFAULT_TARGET_MODULES, build_tiny_model, make_peft_adapter



Case = tuple[Callable[[], object], Callable[[], object] | None]


@dataclass(frozen=True)
class Timing:
    median: float
    min: float
    #: median CPU seconds of this process (all its threads): with ``--threads 1`` the work itself, which other
    #: processes' load does not stretch as it stretches wall time
    cpu: float


def timed(cases: dict[str, Case], device: torch.device, reps: int) -> dict[str, Timing]:
    """Median and minimum seconds per case over ``reps`` rounds after a warm-up round.

    Cases run round-robin (one of each per round) so that load from other
    processes on a shared machine hits every case alike. A case's ``setup``
    runs untimed before it.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(reps + 1):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            synchronize(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            synchronize(device)
            if round_:
                samples[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {name: Timing(statistics.median(values), min(values), statistics.median(cpu[name])) for name, values in samples.items()}


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
        ("forward: ours, mixed batch of 8 adapters", mixed_s, base_s, "<= 1.1x base", lambda r: r <= 1.1),
        ("forward: PEFT mixed batch (adapter_names=)", peft_mixed_s, base_s, "", None),
    ]


SECTIONS = ("swap", "load", "forward")
ROOT = Path(__file__).resolve().parent.parent


def measure(args: argparse.Namespace) -> list[tuple]:
    """This process's rows for the chosen sections (the package it imported: this tree's, or a baseline's)."""
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
        if "swap" in args.sections:
            rows += bench_swap(device, half, args.reps)
        if "load" in args.sections:
            rows += bench_load(Path(tmp), "tiny", lambda: build_tiny_model(dtype=fwd_dtype), device, args.reps)
            rows += bench_load(Path(tmp), "medium", lambda: medium_model(fwd_dtype), device, args.reps)
        if "forward" in args.sections:
            rows += bench_forward(Path(tmp), fwd_dtype, device, args.reps, args.batch, args.seq)
    return rows


def print_rows(rows: list[tuple]) -> None:
    print()
    print(f"load average at end {os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.2f}; ratio = time / the reference row below it (forward: / plain base model)")
    print(f"{'measurement':44} {'median ms':>10} {'ratio':>7} {'min ms':>9} {'ratio':>7} {'CPU ms':>9} {'ratio':>7}  goal (on medians)")
    for name, timing, ref, goal, check in rows:
        ratio, min_ratio, cpu_ratio = timing.median / ref.median, timing.min / ref.min, timing.cpu / max(ref.cpu, 1e-9)
        verdict = "" if check is None else ("  met" if check(ratio) else "  NOT met")
        print(f"{name:44} {timing.median * 1e3:10.2f} {ratio:7.2f} {timing.min * 1e3:9.2f} {min_ratio:7.2f} "
              f"{timing.cpu * 1e3:9.2f} {cpu_ratio:7.2f}  {goal}{verdict}")


def side_by_side(args: argparse.Namespace, passed: list[str]) -> None:
    """``--baseline``: this script in child processes, the baseline's package then this tree's, ``--rounds`` times."""
    from adapter_fabric.harness.baseline import baseline_env

    with tempfile.TemporaryDirectory() as tmp:
        trees = {f"baseline {args.baseline}": {**os.environ, **baseline_env(ROOT, args.baseline, Path(tmp) / "baseline")}, "this tree": dict(os.environ)}
        results: dict[str, list[dict]] = {label: [] for label in trees}
        for n in range(args.rounds):
            for label, env in trees.items():
                out = Path(tmp) / f"{label.replace(' ', '-')}-{n}.json"
                print(f"round {n + 1}/{args.rounds}: {label} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
                subprocess.run([sys.executable, __file__, *passed, "--json", str(out)], env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                child = json.loads(out.read_text())
                if not n:
                    print(f"{label} imported adapter_fabric from {child['package']}", file=sys.stderr, flush=True)
                results[label].append({row["name"]: row for row in child["rows"]})
    print(f"\nmedians over {args.rounds} rounds of each round's median of {args.reps}; ratio = time / the reference row of the same "
          "process; CPU = the process's CPU time (with --threads 1: the work, which others' load stretches least)")
    print(f"{'measurement':44} {'tree':>17} {'ms':>9} {'ratio':>6} {'min ratio':>9} {'CPU ms':>9} {'CPU ratio':>9}")
    for name in results["this tree"][0]:
        for label in trees:
            rounds = [r[name] for r in results[label] if name in r]
            ms = statistics.median(r["median"] for r in rounds) * 1e3
            ratio = statistics.median(r["median"] / r["ref"] for r in rounds)
            min_ratio = statistics.median(r["min"] / r["ref_min"] for r in rounds)
            cpu_ms = statistics.median(r["cpu"] for r in rounds) * 1e3
            cpu_ratio = statistics.median(r["cpu"] / max(r["ref_cpu"], 1e-9) for r in rounds)
            print(f"{name:44} {label:>17} {ms:9.2f} {ratio:6.2f} {min_ratio:9.2f} {cpu_ms:9.2f} {cpu_ratio:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICE_CHOICES)}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)")
    parser.add_argument("--baseline", default="", help="a git revision: its package measured beside this tree's, in turn")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each tree, in turn (medians)")
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # a child's rows, for --baseline
    args = parser.parse_args()
    args.sections = [part for part in args.sections.split(",") if part]
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections takes {', '.join(SECTIONS)}, separated by commas, not {','.join(args.sections)!r}")
    refuse_out_of_range(parser, (
        ("--reps", args.reps, 1, 1000, "timed calls per row, a median"),
        ("--batch", args.batch, 1, 256, "rows of the forward's batch"),
        ("--seq", args.seq, 1, 256, "tokens per row: the medium model's max_position_embeddings"),
        ("--threads", args.threads, 0, 256, "0: torch's default"),
        ("--rounds", args.rounds, 1, 50, "with --baseline: each round runs both trees' children"),
    ))
    try:
        resolve_device(args.device)
    except InvalidArgument:
        parser.error(f"--device takes {', '.join(DEVICE_CHOICES)} (cuda only where torch sees a CUDA device), not {args.device!r}")
    from adapter_fabric.harness.baseline import refuse_unknown_revision

    refuse_unknown_revision(parser, ROOT, args.baseline)
    if args.baseline:
        passed = ["--device", args.device, "--reps", str(args.reps), "--batch", str(args.batch), "--seq", str(args.seq),
                  "--sections", ",".join(args.sections), "--threads", str(args.threads)]
        side_by_side(args, passed)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    if args.json:
        import adapter_fabric

        measured = [{"name": n, "median": t.median, "min": t.min, "cpu": t.cpu, "ref": r.median, "ref_min": r.min, "ref_cpu": r.cpu} for n, t, r, _, _ in rows]
        args.json.write_text(json.dumps({"package": str(Path(adapter_fabric.__file__).parent), "rows": measured}))
    print_rows(rows)


if __name__ == "__main__":
    main()
