#!/usr/bin/env python3
"""Swarm rollout across network namespaces: time until every node has a 64 MiB adapter.

    sudo .venv/bin/python scripts/bench_swarm.py                      # 8 and 16 nodes, 200 Mbit/s links
    sudo .venv/bin/python scripts/bench_swarm.py --nodes 16 --rate-mbit 100
    sudo .venv/bin/python scripts/bench_swarm.py --nodes 16 --skip-star --baseline 277762c --rounds 3   # before/after, in turn
    sudo .venv/bin/python scripts/bench_swarm.py --nodes 16 --skip-star --ideal --rounds 2    # beside the physical limit

Per node count: N store-only nodes (``--model none``), each in its own network
namespace, joined through a bridge; every link limited with tc tbf in both
directions. The adapter (PEFT names, made in code) is staged on node 0, the
seed. Side by side, in one run on the same nodes:

- single: one node pulls from the seed alone (the link-speed baseline);
- swarm:  every other node pulls at once, from the seed and from each other;
- star:   every other node pulls at once from the seed alone.

With ``--baseline REV`` the node processes of each run alternate between
that revision's package (``adapter_fabric.harness.baseline``) and this
tree's, ``--rounds`` times each, on the same namespaces and links. With
``--ideal`` the physical limit runs in turn with them: the same file moved
by minimal forwarders (``scripts/swarm_ideal.py``: a chain and a tree of
fan-out 2, splice/sendfile, no hashing, no RPC) on the same namespaces and
links. ``--mtu 9000`` sets the veths' MTU (an observation of what is per
packet; the goal's lab is the default 1500).

Printed: each mode's slowest node, and ratios against single; under each
mode, what the pulls' traces (FABRIC_PULL_TRACE) say: seed repeats, when every
chunk had left the seed, the share from peers, how requests ended, node CPU. Needs root and
``ip netns``; prints why and exits 0 where they are missing. Namespaces and
processes are removed on exit, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import swarm_ideal  # scripts/: this script's folder is on sys.path
from adapter_fabric.harness import netlab
from adapter_fabric.harness.baseline import baseline_env, refuse_unknown_revision
from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.harness.flag_bounds import refuse_out_of_range

ROOT = Path(__file__).resolve().parent.parent

PORT = 50051
ADAPTER_ID = "bench/swarm"
#: the most nodes a run starts: each a node process (and a namespace) on this machine
MAX_NODES = 64
#: a node's WARNING line for each data channel fallback (``DataChannels.fall_back``; its wording is the same since f1353b6)
FALLBACK_LINE = "fetching from it over gRPC"


# ------------------------------------------------------------------ inner: runs in the ctl namespace


def inner(args: argparse.Namespace) -> dict:
    from adapter_fabric.client.node_client import NodeClient
    from adapter_fabric.harness.cluster import LocalNode
    from adapter_fabric.client.rollout import rollout

    lab = netlab.NetLab(args.prefix, args.count, args.rate_mbit, subnet=args.subnet, mtu=args.mtu)
    addresses = [f"{lab.node_ip(i)}:{PORT}" for i in range(args.count)]
    work = Path(args.work)
    trace_dir = work / "traces"
    nodes = [
        LocalNode(
            work / f"n{i}", model="none", host=lab.node_ip(i), port=PORT, netns=lab.node_ns(i),
            peers=[a for a in addresses if a != addresses[i]],
            # --homes 0: the seed's Stage stays on the seed (with placement it would be pushed to its homes before the rollout);
            # every revision since issue 32 (413ef82) takes it, so a --node-pythonpath baseline does too
            extra_args=["--chunk-size", str(args.chunk_kib << 10), "--log-level", "WARNING", "--stall-timeout", "30", "--homes", "0"],
            env={"FABRIC_PULL_TRACE": str(trace_dir), **({"PYTHONPATH": args.node_pythonpath} if args.node_pythonpath else {})},
        )
        for i in range(args.count)
    ]  # fmt: skip
    seed, receivers = addresses[0], addresses[1:]

    def nodes_cpu() -> tuple[float, float]:
        """(user, system) CPU seconds of every node process so far (the whole host has os.cpu_count() cores)."""
        user = system = 0.0
        for node in nodes:
            fields = Path(f"/proc/{node.pid}/stat").read_text().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
        tick = os.sysconf("SC_CLK_TCK")
        return user / tick, system / tick
    staged = None

    def fallbacks() -> int:
        """The nodes' data channel fallbacks so far (each a peer fetched from over gRPC for a while): their WARNING lines."""
        return sum(n.log_path.read_text(errors="replace").count(FALLBACK_LINE) for n in nodes if n.log_path.exists())

    def client(address: str) -> NodeClient:
        return NodeClient(address, timeout=1800)

    def clear() -> None:
        for address in receivers:
            with client(address) as c:
                try:
                    c.unstage(ADAPTER_ID)
                except Exception:
                    pass

    def timed(mode: str, targets: list[str], named_peer_only: bool) -> dict:
        clear()
        subprocess.run(["rm", "-rf", str(trace_dir)], check=True)
        trace_dir.mkdir(parents=True)
        net_before = lab.counters(node.pid for node in nodes)
        cpu_before, host_before, wall_before, fallbacks_before = nodes_cpu(), swarm_ideal.host_cpu_s(), time.monotonic(), fallbacks()
        results = rollout(targets, ADAPTER_ID, seed, stage_only=True, named_peer_only=named_peer_only, client_for=client)
        failed = [r for r in results if not r.ok]
        if failed:
            raise SystemExit(f"{mode}: {failed[0].node}: {failed[0].error}")
        seconds = sorted(r.seconds for r in results)
        row = {"mode": mode, "digest_ok": all(r.digest == staged.digest for r in results), "nodes": len(targets), "slowest_s": seconds[-1], "fastest_s": seconds[0], "median_s": seconds[len(seconds) // 2]}
        row["bytes_moved"] = sum(r.bytes_transferred for r in results)
        user, system = (after - before for after, before in zip(nodes_cpu(), cpu_before))
        host = swarm_ideal.deltas(host_before, swarm_ideal.host_cpu_s())
        row["node_cpu_s"] = {"user": user, "system": system, "wall": time.monotonic() - wall_before, "host_load": os.getloadavg()[0], "host": host}
        row["net"] = swarm_ideal.deltas(net_before, lab.counters(node.pid for node in nodes))
        print(f"  {mode:<6} {len(targets):>2} receivers: slowest {seconds[-1]:6.2f} s  median {row['median_s']:6.2f} s  fastest {seconds[0]:6.2f} s", file=sys.stderr, flush=True)
        row["trace"] = {**analyse_traces(trace_dir, seed), "fallbacks": fallbacks() - fallbacks_before}
        if args.keep_traces:
            Path(args.keep_traces).mkdir(parents=True, exist_ok=True)  # cp -r names, it does not make, the parent
            subprocess.run(["cp", "-r", str(trace_dir), f"{args.keep_traces}/{args.count}-{mode}"], check=True)
        print("         " + format_trace(row["trace"]), file=sys.stderr, flush=True)
        print("         " + format_cpu("node processes", row["node_cpu_s"]), file=sys.stderr, flush=True)
        print("         " + swarm_ideal.format_net(row["net"]), file=sys.stderr, flush=True)
        return row

    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
        with client(seed) as c:
            staged = c.stage(args.adapter, ADAPTER_ID)
        idle = None
        if args.idle_s:  # what the nodes cost doing nothing (their timers and polls), before any rollout
            cpu_before, host_before = nodes_cpu(), swarm_ideal.host_cpu_s()
            time.sleep(args.idle_s)
            user, system = (after - before for after, before in zip(nodes_cpu(), cpu_before))
            idle = {"user": user, "system": system, "wall": args.idle_s, "host_load": os.getloadavg()[0], "host": swarm_ideal.deltas(host_before, swarm_ideal.host_cpu_s())}
            print(f"  idle   {args.count} nodes for {args.idle_s:g} s: " + format_cpu("node processes", idle), file=sys.stderr, flush=True)
        rows = [timed("single", receivers[:1], True)]
        rows.append(timed("swarm", receivers, False))
        if not args.skip_star:
            rows.append(timed("star", receivers, True))
        return {"count": args.count, "rate_mbit": args.rate_mbit, "size": staged.bytes_received, "chunk_kib": args.chunk_kib, "rows": rows, "idle": idle}
    finally:
        for node in nodes:
            node.stop(timeout=10)


def analyse_traces(trace_dir: Path, seed: str) -> dict:
    """What the pulls' traces (FABRIC_PULL_TRACE) say about where the time went.

    seed_chunks: chunks the seed delivered in all; seed_dups: of those, copies
    of a chunk it had delivered before (each chunk must leave the seed once;
    every copy beyond costs seed upload); peer_share: the fraction of
    chunks that came from peers other than the seed; seed_idle_s: per pull,
    the seconds with no request outstanding at the seed (median); first_peer_s:
    when the first chunk from a non-seed peer landed (median over pulls);
    seed_done_s: when the seed had delivered every chunk at least once.
    """
    pulls = [json.loads(p.read_text()) for p in sorted(trace_dir.glob("pull-*.json"))]
    from_seed: list[int] = []
    first_seen: dict[int, float] = {}
    peer_chunks = idle = 0
    idles, first_peer, ends, kinds = [], [], [], {}
    news = {"poll": 0, "held": 0, "hint": 0}  # Availability polls, and holdings learnt for free (Fetch trailers, request hints)
    for pull in pulls:
        outstanding, since, idle = 0, 0.0, 0.0
        first = None
        for t, kind, peer, chunks in pull["events"]:
            if kind in news:
                news[kind] += 1
                continue
            if kind == "chunk":
                if peer == seed:
                    from_seed.append(chunks[0])
                    first_seen[chunks[0]] = min(t, first_seen.get(chunks[0], t))
                else:
                    peer_chunks += 1
                    first = t if first is None else first
                continue
            if kind != "start":
                kinds[kind] = kinds.get(kind, 0) + 1
            if peer != seed or kind == "dup":
                continue
            if kind == "start":
                if outstanding == 0:
                    idle += t - since
                outstanding += 1
            else:
                outstanding -= 1
                if outstanding == 0:
                    since = t
        end = pull["events"][-1][0] if pull["events"] else 0.0
        ends.append(end)
        idles.append(idle)
        first_peer.append(first if first is not None else end)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    total = len(from_seed) + peer_chunks
    return {
        "pulls": len(pulls),
        "polls": news["poll"],
        "free_news": news["held"] + news["hint"],
        "seed_chunks": len(from_seed),
        "seed_dups": len(from_seed) - len(set(from_seed)),
        "peer_share": peer_chunks / total if total else 0.0,
        "seed_idle_s": median(idles),
        "first_peer_s": median(first_peer),
        "seed_done_s": max(first_seen.values()) if first_seen else 0.0,
        "ends": kinds,
    }


def format_cpu(who: str, cpu: dict) -> str:
    host = cpu["host"]
    return (
        f"{who} used {cpu['user']:.1f} s user + {cpu['system']:.1f} s system CPU in {cpu['wall']:.1f} s (host load {cpu['host_load']:.1f}); "
        f"the host: {host['user'] + host['nice']:.1f} s user, {host['system']:.1f} s system, {host['softirq'] + host['irq']:.1f} s irq+softirq, {host['idle']:.1f} s idle"
    )


def run_ideal(args: argparse.Namespace, count: int, adapter: Path) -> dict:
    """The physical limit on a lab like the fabric's: one receiver alone, then the chain and the tree of fan-out 2."""
    lab = netlab.NetLab(args.prefix, count, args.rate_mbit, subnet=args.subnet, mtu=args.mtu)
    source = adapter / "adapter_model.safetensors"
    rows = []
    try:
        lab.up()
        for receivers, topology in ((1, "chain"), (count - 1, "chain"), (count - 1, "tree2")):
            row = swarm_ideal.run(lab, receivers, topology, source, Path(args.work) / "ideal")
            row["cpu_s"]["host_load"] = os.getloadavg()[0]
            print(f"  {row['mode']:<12} {receivers:>2} receivers: slowest {row['slowest_s']:6.2f} s  median {row['median_s']:6.2f} s  fastest {row['fastest_s']:6.2f} s", file=sys.stderr, flush=True)
            print("         " + format_cpu("forwarders", row["cpu_s"]), file=sys.stderr, flush=True)
            print("         " + swarm_ideal.format_net(row["net"]), file=sys.stderr, flush=True)
            if not row["intact"]:
                raise SystemExit(f"{row['mode']}: a receiver's file differs from the seed's")
            rows.append({**row, "node_cpu_s": row.pop("cpu_s")})
    finally:
        lab.down()
    return {"count": count, "rate_mbit": args.rate_mbit, "size": source.stat().st_size, "chunk_kib": 0, "rows": rows}


def format_trace(t: dict) -> str:
    return (
        f"seed sent {t['seed_chunks']} chunks ({t['seed_dups']} repeats, all out at {t['seed_done_s']:.1f} s); "
        f"{100 * t['peer_share']:.0f}% from peers; first peer chunk at {t['first_peer_s']:.1f} s; "
        f"seed link idle {t['seed_idle_s']:.1f} s per pull; request ends {t['ends']}; {t['polls']} Availability polls, {t['free_news']} holdings learnt from Fetch metadata; "
        f"{t.get('fallbacks', 0)} data channel fallbacks to gRPC"
    )


# ------------------------------------------------------------------ outer: sets up and tears down


def run_count(args: argparse.Namespace, count: int, adapter: Path, pythonpath: str = "") -> dict:
    lab = netlab.NetLab(args.prefix, count, args.rate_mbit, subnet=args.subnet, mtu=args.mtu)
    try:
        lab.up()
        work = Path(args.work) / f"c{count}"
        subprocess.run(["rm", "-rf", str(work)], check=True)
        command = [
            *lab.exec_prefix(lab.ctl), sys.executable, str(Path(__file__).resolve()), "--inner",
            "--prefix", args.prefix, "--count", str(count), "--rate-mbit", str(args.rate_mbit), "--chunk-kib", str(args.chunk_kib),
            "--adapter", str(adapter), "--work", str(work), "--subnet", args.subnet, "--keep-traces", args.keep_traces, *(["--skip-star"] if args.skip_star else []),
            "--node-pythonpath", pythonpath, "--mtu", str(args.mtu), "--idle-s", str(args.idle_s),
        ]  # fmt: skip
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"bench with {count} nodes failed (exit {out.returncode}); node logs under {work}")
        return json.loads(out.stdout)
    finally:
        lab.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,16", help=f"comma-separated node counts (seed included; each 2 to {MAX_NODES})")
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="each link, each direction (10 to 10000)")
    parser.add_argument("--size-mib", type=int, default=64, help="the adapter's size (1 to 1024)")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="the nodes' --chunk-size (4 to 4096)")
    parser.add_argument("--skip-star", action="store_true", help="leave out the slow seeder-only baseline")
    parser.add_argument("--prefix", default="fswb")
    parser.add_argument("--subnet", default="10.203.0", help="the bridge's /24 (node i is .i+1)")
    parser.add_argument("--work", default="/dev/shm/fabric-bench-swarm", help="node stores and logs (tmpfs keeps the disk out of the figures)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep-traces", default="", help="copy each mode's pull traces under this directory")
    parser.add_argument("--baseline", default="", help="a git revision: its nodes run in turn with this tree's, on the same links")
    parser.add_argument("--rounds", type=int, default=1, help="with --baseline or --ideal: runs of each, in turn (1 to 50)")
    parser.add_argument("--ideal", action="store_true", help="also the physical limit: minimal forwarders on the same links (scripts/swarm_ideal.py)")
    parser.add_argument("--mtu", type=int, default=0, help="the veths' MTU (0: the kernel's 1500; else 68 to 65535)")
    parser.add_argument("--idle-s", type=float, default=0.0, help="first measure the nodes' CPU this many seconds idle (0 to 600)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--node-pythonpath", default="", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    counts = [int(c) if c.isascii() and c.isdigit() else 0 for c in args.nodes.split(",")]
    if not all(2 <= c <= MAX_NODES for c in counts):
        parser.error(f"--nodes takes node counts separated by commas, each 2 to {MAX_NODES} (a seed and a receiver at least; each node a process here), not {args.nodes!r}")
    refuse_out_of_range(parser, (
        ("--rate-mbit", args.rate_mbit, 10, 10_000, "each link's tbf rate in Mbit/s; slower links stretch a run to hours"),
        ("--size-mib", args.size_mib, 1, 1024, "every node stores a copy under --work, tmpfs by default"),
        ("--chunk-kib", args.chunk_kib, 4, 4096, "a node's --chunk-size takes 4 KiB to 4 MiB"),
        ("--rounds", args.rounds, 1, 50, "each round sets up the links and nodes again"),
        ("--idle-s", args.idle_s, 0, 600, "seconds the nodes' CPU is measured idle first"),
    ))
    if not (args.mtu == 0 or 68 <= args.mtu <= 65535):
        parser.error(f"--mtu takes 0 (the kernel's 1500) or 68 to 65535 (IPv4's least, a veth's most), not {args.mtu}")
    refuse_unknown_revision(parser, ROOT, args.baseline)

    if args.inner:
        print(json.dumps(inner(args)))
        return
    ok, why = netlab.available()
    if not ok:
        print(f"bench_swarm: skipped ({why})")
        return
    # SIGTERM unwinds like Ctrl-C, so the finally blocks remove namespaces and processes.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    adapter = make_adapter(Path(args.work) / "adapter", args.size_mib)
    trees: list[tuple[str, str | None]] = [("this tree", "")]
    if args.baseline:
        trees.insert(0, (f"baseline {args.baseline}", baseline_env(ROOT, args.baseline, Path(args.work) / "baseline")["PYTHONPATH"]))
    if args.ideal:
        trees.append(("ideal", None))  # None: the forwarders, not nodes
    results = []
    try:
        for count in counts:
            for round_ in range(args.rounds if len(trees) > 1 else 1):
                for tree, pythonpath in trees:
                    print(f"{count} nodes, {args.rate_mbit:g} Mbit/s links{f', MTU {args.mtu}' if args.mtu else ''}, {args.size_mib} MiB adapter, {args.chunk_kib} KiB chunks ({tree}, round {round_ + 1}):", file=sys.stderr, flush=True)
                    result = run_ideal(args, count, adapter) if pythonpath is None else run_count(args, count, adapter, pythonpath)
                    results.append({**result, "tree": tree})
    finally:
        subprocess.run(["rm", "-rf", args.work])
    print()
    print("| tree | nodes | link | mode | receivers | slowest s | median s | fastest s | slowest / single | CPU user + system s | host irq+softirq s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios: dict[tuple[str, int, str], list[float]] = {}
    for result in results:
        single = result["rows"][0]["slowest_s"]
        for row in result["rows"]:
            ratios.setdefault((result["tree"], result["count"], row["mode"]), []).append(row["slowest_s"] / single)
            print(
                f"| {result['tree']} | {result['count']} | {result['rate_mbit']:g} Mbit/s | {row['mode']} | {row['nodes']} | {row['slowest_s']:.2f} | "
                f"{row['median_s']:.2f} | {row['fastest_s']:.2f} | {row['slowest_s'] / single:.2f} | "
                f"{row['node_cpu_s']['user']:.1f} + {row['node_cpu_s']['system']:.1f} | {row['node_cpu_s']['host']['irq'] + row['node_cpu_s']['host']['softirq']:.1f} |"
            )
    if len(results) > 1:
        print()
        for (tree, count, mode), values in ratios.items():
            print(f"{tree}, {count} nodes, {mode}: slowest / single, median of {len(values)}: {sorted(values)[len(values) // 2]:.2f} ({', '.join(f'{v:.2f}' for v in values)})")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
