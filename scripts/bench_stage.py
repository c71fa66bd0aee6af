#!/usr/bin/env python3
"""Publishing many small adapters through a node's Stage RPC: one at a time against the bulk path, side by side.

    python scripts/bench_stage.py --adapters 500 --workers 16
    python scripts/bench_stage.py --adapters 10000 --workers 32 --baseline t30 --rounds 2   # before/after, bulk only
    python scripts/bench_stage.py --adapters 5000 --workers 32 --ask-each --rounds 3   # the client's UploadOffset per adapter, or not
    python scripts/bench_stage.py --adapters 10000 --workers 16 --per-adapter --rounds 1   # StageMany against a Stage per adapter
    python scripts/bench_stage.py --adapters 2000 --workers 32 --quota --baseline 6163a67 --bulk-only   # the ids' tenant under a [[quota]]

Real store-only node processes on loopback (``adapter_fabric.harness.cluster``), a
fresh store each: the first stages every adapter one after another
(``NodeClient.stage``), the second all of them through ``NodeClient.stage_many``
(small adapters on one StageMany stream, committed in groups; ``--per-adapter``:
``--workers`` concurrent Stage calls, which the node's committer syncs in
groups, as stage-many sent them before StageMany). ``--quota``: every node runs a
policy whose ``[[quota]]`` covers the staged ids (``bench/``), so every writer
asks for that tenant's usage first. All keep the same
durability: an adapter answered is on disk. The load average is printed
before and after (a shared machine).
The adapters are distinct small PEFT adapters (a tiny model's, ~20 KB each),
each a copy of one with a few bytes of its tensor data changed, so each has
its own digest and blob. Prints adapters/s for each and the ratio; both
stores are checked to list every adapter after their node restarts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapter_fabric.client.bulk import BatchStage, stage_many  # noqa: E402
from adapter_fabric.client.node_client import UPLOAD_PIECE  # noqa: E402
from adapter_fabric.harness.baseline import baseline_env, refuse_unknown_revision  # noqa: E402
from adapter_fabric.harness.bench import make_small_adapters  # noqa: E402
from adapter_fabric.harness.cluster import LocalNode  # noqa: E402
from adapter_fabric.harness.flag_bounds import refuse_out_of_range  # noqa: E402

#: bounds on the flags: a typo must not fill the disk
MAX_ADAPTERS = 20_000
MAX_WORKERS = 64


def quota_policy(root: Path) -> list[str]:
    """The flags of a node whose policy puts the staged ids' tenant (``bench/``) under a quota; the admin's token beside it."""
    (root / "admin.token").write_text(secrets.token_hex(32))
    reader = hashlib.sha256(secrets.token_hex(32).encode()).hexdigest()  # a policy names one principal at least
    (root / "policy.toml").write_text(
        f'[[principal]]\nname = "reader"\ntoken_sha256 = "{reader}"\ngrants = [{{ verbs = ["read"], prefixes = ["*"] }}]\n'
        '[[quota]]\nprefix = "bench/"\nmax_bytes = "100GiB"\nmax_adapters = 1000000\n'
    )
    return ["--policy", str(root / "policy.toml")]


def run(
    root: Path, name: str, dirs: list[Path], workers: int, env: dict[str, str] | None = None, ask_each: bool = False, per_adapter: bool = False,
    quota: bool = False,
) -> float:
    """Adapters per second staging ``dirs`` into a fresh node (one at a time when ``workers`` is 0); checks they survive a restart.

    ``env``: the node's environment (``adapter_fabric.harness.baseline``: another revision's package). ``ask_each``: the bulk
    path as the client ran it before ``BatchStage``, with an UploadOffset call per adapter. ``per_adapter``: a Stage call per
    adapter (``BatchStage``), as before StageMany."""
    flags, token = (quota_policy(root), root / "admin.token") if quota else ([], None)
    node = LocalNode(root / name, model="none", env=env, extra_args=flags, token_file=token).start()
    try:
        with node.client() as client:
            items = [(d, f"bench/{d.name}") for d in dirs]
            started = time.perf_counter()
            if workers == 0:
                for directory, adapter_id in items:
                    client.stage(directory, adapter_id)
            else:
                if ask_each:
                    result = stage_many(lambda d, i: client.stage(d, i), items, workers)
                elif per_adapter:
                    result = stage_many(BatchStage(client, None, UPLOAD_PIECE), items, workers)
                else:
                    result = client.stage_many(items, workers=workers)
                if result.failed:
                    raise SystemExit(f"{name}: {len(result.failed)} failed, first {result.failed[0].adapter_id}: {result.failed[0].error}")
            seconds = time.perf_counter() - started
    finally:
        node.stop()
    node = LocalNode(root / name, model="none", extra_args=flags, token_file=token).start()  # the same store, restarted: every adapter is still there
    try:
        with node.client() as client:
            listed = len(client.list().staged)
    finally:
        node.stop()
    if listed != len(dirs):
        raise SystemExit(f"{name}: {listed} adapters listed after a restart, {len(dirs)} staged")
    return len(dirs) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=500, help=f"small adapters to stage (1 to {MAX_ADAPTERS})")
    parser.add_argument("--workers", type=int, default=16, help=f"concurrent Stage calls of the bulk path (1 to {MAX_WORKERS})")
    parser.add_argument("--dir", type=Path, default=None, help="where the adapters and stores go (default: a temp directory, removed after)")
    parser.add_argument("--baseline", default="", help="a git revision: its node's bulk path measured beside this tree's, in turn")
    parser.add_argument("--rounds", type=int, default=1, help="with --baseline: each bulk run this many times, in turn (medians; 1 to 50)")
    parser.add_argument("--bulk-only", action="store_true", help="leave out the one-at-a-time row (slow at thousands)")
    parser.add_argument("--ask-each", action="store_true", help="the bulk path with an UploadOffset call per adapter beside this tree's, in turn")
    parser.add_argument("--quota", action="store_true", help="every node's policy puts the staged ids' tenant under a [[quota]]")
    parser.add_argument("--per-adapter", action="store_true", help="this tree's Stage call per adapter (no StageMany) beside its StageMany path, in turn")
    args = parser.parse_args(argv)
    refuse_out_of_range(parser, (
        ("--adapters", args.adapters, 1, MAX_ADAPTERS, "each made and staged on every run"),
        ("--workers", args.workers, 1, MAX_WORKERS, "concurrent Stage calls"),
        ("--rounds", args.rounds, 1, 50, "each round stages every adapter on both paths' nodes"),
    ))
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir takes a directory that exists (a temporary one is made in it), not {str(args.dir)!r}")
    refuse_unknown_revision(parser, ROOT, args.baseline)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        (root / "adapters").mkdir()
        dirs = make_small_adapters(root / "adapters", args.adapters)
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        if args.baseline or args.ask_each or args.per_adapter:
            env = baseline_env(ROOT, args.baseline, root / "baseline") if args.baseline else None
            base = args.baseline or ("a Stage per adapter" if args.per_adapter else "UploadOffset per adapter")
            rates: dict[str, list[float]] = {base: [], "this tree": []}
            for n in range(args.rounds):
                for label, tree_env, ask, per in ((base, env, args.ask_each, args.per_adapter), ("this tree", None, False, False)):
                    rates[label].append(run(root, f"bulk-{label.replace(' ', '-')}-{n}", dirs, args.workers, tree_env, ask, per, args.quota))
                    print(f"round {n + 1} {label}: {rates[label][-1]:.1f} adapters/s (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            before, after = (statistics.median(r) for r in rates.values())
            print(f"bulk (stage_many, {args.workers} workers), {args.adapters} adapters, medians of {args.rounds}{', the tenant under a quota' if args.quota else ''}")
            print(f"| tree | adapters/s | {args.adapters:,} adapters in |\n|---|---:|---:|")
            for label, rate in ((f"baseline ({base})", before), ("this tree", after)):
                print(f"| {label} | {rate:.1f} | {args.adapters / rate:.1f} s |")
            print(f"this tree / baseline: {after / before:.2f}x; 10,000 adapters would take {10_000 / after:.0f} s (baseline {10_000 / before:.0f} s)")
            return
        one = 0.0 if args.bulk_only else run(root, "one-at-a-time", dirs, 0, quota=args.quota)
        bulk = run(root, "bulk", dirs, args.workers, quota=args.quota)
    print(f"{'path':<34}{'adapters':>9}{'adapters/s':>12}")
    if one:
        print(f"{'one at a time (NodeClient.stage)':<34}{args.adapters:>9}{one:>12.1f}")
    print(f"{f'bulk (stage_many, {args.workers} workers)':<34}{args.adapters:>9}{bulk:>12.1f}")
    if one:
        print(f"bulk / one at a time: {bulk / one:.1f}x; 10,000 adapters would take {10_000 / bulk:.0f} s in bulk, {10_000 / one:.0f} s one at a time")


if __name__ == "__main__":
    main()
