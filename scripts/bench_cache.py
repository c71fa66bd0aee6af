#!/usr/bin/env python3
"""The store as a cluster cache under a real workload: a Zipf stream of adapter requests over real nodes.

    .venv/bin/python scripts/bench_cache.py                        # 8 nodes, 2,000 adapters, 20,000 requests
    .venv/bin/python scripts/bench_cache.py --quick                # 4 nodes, 120 adapters, 400 requests (the test's size)

Real store-only node processes (``--model none``) on loopback. Node 0 is the
origin: every adapter staged into its store in-process before it starts
(``adapter_fabric.harness.adapter_sets``: a few real PEFT adapters of the tiny model,
the rest derived from them, each distinct), started with ``--when-full
refuse``, so it never evicts. Every other node is a cache: ``--when-full
evict`` and ``--max-store-bytes`` at ``--cache-share`` (10%) of the origin's
bytes. Each cache lists its peers as the other caches (in a seeded order of
its own) and the origin last: the origin is the seed of last resort.

The stream: ``--requests`` requests, each for an adapter drawn from Zipf(s)
over a seeded ranking of the adapters, sent to a random cache, ``--in-flight``
at once (engines resolving adapters side by side). A request takes the
resolver's path (``adapter_fabric.integrations.vllm_resolver``): the adapter is ready
if the node holds it (a pull with no peer, which also marks it used), else the
node is asked which peers hold it (Locate) and pulls it from the first
complete holder (and the swarm). Side by side, in the same run:

- refusals (QuotaExceeded; goal 0) and other errors;
- each cache's hit ratio against an LRU simulation of the same per-node trace
  (same byte limit; goal within 5 points);
- time to ready on a miss (median, p99) against one pull's time measured alone
  (the same path on a quiet cluster before the stream);
- the share of the bytes sent to peers (``fabric_served_bytes_total``) that
  the origin sent, after the first ``--warmup`` of the stream (goal <= 25%);
- whether every adapter still has a complete copy on some node at the end.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import concurrent.futures
import json
import random
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapter_fabric.errors import AdapterNotFound, QuotaExceeded  # noqa: E402
from adapter_fabric.harness import adapter_sets  # noqa: E402
from adapter_fabric.harness.cluster import LocalNode, free_port, start_all  # noqa: E402
from adapter_fabric.harness.flag_bounds import refuse_out_of_range  # noqa: E402

QUICK = {"nodes": 4, "adapters": 120, "requests": 400, "baseline": 8, "jobs": 1}
#: bounds on the flags, and why (a run is a few processes on one machine)
LIMITS = {
    "nodes": (3, 64, "the origin and two caches at least; each node a process on this machine"),
    "adapters": (10, 100_000, "each staged on the origin before the stream"),
    "requests": (1, 1_000_000, "the stream is timed request by request"),
    "in_flight": (1, 64, "engines resolving adapters side by side"),
    "baseline": (1, 1000, "pulls timed alone before the stream"),
    "jobs": (1, 16, "processes staging the origin's adapters"),
    "zipf": (0, 3, "the Zipf exponent s"),
    "cache_share": (0.01, 1, "each cache's byte limit as a share of the origin's bytes"),
    "warmup": (0, 0.9, "the share of the stream before the origin's bytes are counted"),
}


def zipf_stream(count: int, requests: int, caches: int, s: float, seed: int) -> list[tuple[int, int]]:
    """``(cache index, adapter index)`` per request: adapters by Zipf(s) over a seeded ranking, caches uniform."""
    rng = random.Random(seed)
    ranking = list(range(count))
    rng.shuffle(ranking)
    cumulative, total = [], 0.0
    for rank in range(1, count + 1):
        total += rank**-s
        cumulative.append(total)
    return [(rng.randrange(caches), ranking[min(count - 1, bisect.bisect(cumulative, rng.random() * total))]) for _ in range(requests)]


def lru_hits(trace: list[int], sizes: list[int], limit: int) -> int:
    """Hits of a plain LRU cache of ``limit`` bytes over ``trace`` (evicting only what each miss needs)."""
    cache: collections.OrderedDict[int, int] = collections.OrderedDict()
    used = hits = 0
    for a in trace:
        if a in cache:
            hits += 1
            cache.move_to_end(a)
            continue
        while cache and used + sizes[a] > limit:
            used -= cache.popitem(last=False)[1]
        cache[a] = sizes[a]
        used += sizes[a]
    return hits


def served_bytes(node: LocalNode, name: str = "fabric_served_bytes_total") -> float:
    """The node's ``fabric_served_bytes_total`` (bytes sent to peers in Fetch responses), or another counter summed."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


class Requester:
    """One request the resolver's way, timed; counts what happened (thread-safe)."""

    def __init__(self, nodes: list[LocalNode], placed: bool = False) -> None:
        #: with placement (--homes) a request is one pull naming no peer: the node asks the homes, or its first home the origin
        self.placed = placed
        self.clients = [n.client(timeout=60, long_timeout=120) for n in nodes]
        self.lock = threading.Lock()
        self.hits: collections.Counter[int] = collections.Counter()
        self.misses: list[float] = []
        self.refusals = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def ready(self, node: int, adapter: int) -> tuple[bool, float]:
        """Make adapter ``adapter`` ready on node ``node``: ``(was it there, seconds)``."""
        client, adapter_id = self.clients[node], adapter_sets.adapter_id(adapter)
        start = time.perf_counter()
        # The resolver's way: one pull naming no peer; the node answers what it holds (a hit: nothing moved), else pulls
        # it from its known peers (the swarm) itself (node.origin_fetch).
        reply = client.pull(adapter_id)
        return not reply.source_peers and not reply.joined, time.perf_counter() - start

    def request(self, node: int, adapter: int) -> None:
        try:
            hit, seconds = self.ready(node, adapter)
        except QuotaExceeded:
            with self.lock:
                self.refusals += 1
            return
        except Exception as exc:  # counted and shown, never fatal: the run reports what went wrong
            with self.lock:
                self.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            return
        with self.lock:
            if hit:
                self.hits[node] += 1
            else:
                self.misses.append(seconds)

    def run(self, stream: list[tuple[int, int]], in_flight: int) -> float:
        """Every request of ``stream`` (node indices into the requester's nodes), ``in_flight`` at once; the seconds taken."""
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            for future in [pool.submit(self.request, node, adapter) for node, adapter in stream]:
                future.result()
        return time.perf_counter() - start

    def close(self) -> None:
        for client in self.clients:
            client.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def start_cluster(args: argparse.Namespace, work: Path, limit: int) -> list[LocalNode]:
    """The origin (node 0, its store populated already) and the caches, started together."""
    ports = [free_port() for _ in range(args.nodes)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    quiet = ["--metrics-listen", "127.0.0.1:0", "--log-level", "WARNING"]
    nodes = [LocalNode(work / "n0", model="none", port=ports[0], extra_args=["--when-full", "refuse", "--homes", "0", *quiet])]
    order = random.Random(args.seed + 1)
    for i in range(1, args.nodes):
        others = [a for a in addresses[1:] if a != addresses[i]]
        order.shuffle(others)
        extra = ["--when-full", "evict", "--max-store-bytes", str(limit), "--homes", "0", *quiet]  # the mesh: every peer asked
        nodes.append(LocalNode(work / f"n{i}", model="none", port=ports[i], peers=[*others, addresses[0]], extra_args=extra))
    return start_all(nodes)


def start_fleet(args: argparse.Namespace, work: Path, limit: int, origin: str) -> list[LocalNode]:
    """With placement: every node a cache (--homes, the others as --peers), the adapters at a ``file://`` origin."""
    ports = [free_port() for _ in range(args.nodes)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    extra = ["--homes", str(args.homes), "--origin", origin, "--when-full", "evict", "--max-store-bytes", str(limit)]
    extra += ["--metrics-listen", "127.0.0.1:0", "--log-level", "WARNING"]
    nodes = [
        LocalNode(work / f"n{i}", model="none", port=ports[i], peers=[a for a in addresses if a != addresses[i]], extra_args=extra)
        for i in range(args.nodes)
    ]
    return start_all(nodes)


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    made = time.perf_counter()
    reals = adapter_sets.real_adapters(work / "reals")
    placed = args.homes > 0
    if placed:  # the origin is a directory every node reads (--origin file://...); every node is a cache
        total = adapter_sets.write_directories(work / "origin", reals, args.adapters)
    else:
        total = adapter_sets.populate(work / "n0", reals, args.adapters, jobs=args.jobs)
    print(f"origin: {args.adapters} adapters, {total} bytes, made in {time.perf_counter() - made:.1f} s", file=sys.stderr, flush=True)
    limit = int(total * args.cache_share)
    nodes = start_fleet(args, work, limit, f"file://{work / 'origin'}") if placed else start_cluster(args, work, limit)
    requester = Requester(nodes, placed)
    first = 0 if placed else 1  # the first cache's index among the nodes
    try:
        if placed:
            sizes = [sum(f.stat().st_size for f in (work / "origin" / adapter_sets.adapter_id(i)).iterdir()) for i in range(args.adapters)]
        else:
            with nodes[0].client() as origin:
                listing = {a.adapter_id: a.size for a in origin.list().staged}
            sizes = [listing[adapter_sets.adapter_id(i)] for i in range(args.adapters)]
        stream = zipf_stream(args.adapters, args.requests, args.nodes - first, args.zipf, args.seed)
        # One pull alone, the same path, on a quiet cluster: adapters the stream asks for least (then dropped again).
        wanted = collections.Counter(a for _, a in stream)
        cold = sorted(range(args.adapters), key=lambda a: (wanted[a], a))[: args.baseline]
        alone = [requester.ready(1, a)[1] for a in cold]
        for a in cold:
            for client in requester.clients[first:] if placed else requester.clients[1:2]:
                try:
                    client.unstage(adapter_sets.adapter_id(a))  # with placement its homes took it too
                except AdapterNotFound:
                    pass
        # Cache indices 0.. map to nodes first..; the stream runs in two parts so the served bytes can be read between them.
        requests = [(cache + first, a) for cache, a in stream]
        split = int(len(requests) * args.warmup)
        seconds = requester.run(requests[:split], args.in_flight)
        before = [served_bytes(n) for n in nodes]
        from_origin = sum(served_bytes(n, "fabric_origin_received_bytes_total") for n in nodes) if placed else 0.0
        misses_in_warmup = len(requester.misses)
        seconds += requester.run(requests[split:], args.in_flight)
        after = [served_bytes(n) for n in nodes]
        sent = [b - a for a, b in zip(before, after)]
        if placed:  # the origin's bytes are what the nodes received from it; the peers' are what they served each other
            sent = [sum(served_bytes(n, "fabric_origin_received_bytes_total") for n in nodes) - from_origin, *sent]
        rows = []
        for i in range(first, args.nodes):
            trace = [a for node, a in requests if node == i]
            with nodes[i].client() as c:
                status = c.store_status()
            rows.append({
                "node": i, "requests": len(trace), "hit_ratio": requester.hits[i] / max(1, len(trace)),
                "lru_ratio": lru_hits(trace, sizes, limit) / max(1, len(trace)), "evictions": status.evictions,
                "used_bytes": status.used_bytes,
            })  # fmt: skip
        holders: set[str] = set()
        for node in nodes:
            with node.client() as c:
                holders.update(a.adapter_id for a in c.list().staged if not a.damaged)
        if placed:  # the origin keeps every adapter whole
            holders.update(p.parent.name + "/" + p.name for p in (work / "origin").glob("*/*") if (p / "adapter_model.safetensors").is_file())
        missing = [adapter_sets.adapter_id(i) for i in range(args.adapters) if adapter_sets.adapter_id(i) not in holders]
        return {
            "nodes": args.nodes, "homes": args.homes, "adapters": args.adapters, "total_bytes": total, "cache_limit_bytes": limit, "requests": args.requests,
            "in_flight": args.in_flight, "zipf": args.zipf, "seed": args.seed, "seconds": seconds,
            "refusals": requester.refusals, "errors": dict(requester.errors), "per_node": rows,
            "alone_median_s": statistics.median(alone), "miss_count": len(requester.misses),
            "miss_median_s": percentile(requester.misses, 0.5), "miss_p99_s": percentile(requester.misses, 0.99),
            "misses_after_warmup": len(requester.misses) - misses_in_warmup,
            "origin_share_after_warmup": sent[0] / sum(sent) if sum(sent) else 0.0, "served_bytes_after_warmup": sum(sent),
            "adapters_without_copy": len(missing), "complete_copies": args.adapters - len(missing),
        }  # fmt: skip
    finally:
        requester.close()
        for node in nodes:
            node.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(r: dict) -> str:
    lines = [
        (f"{r['nodes']} nodes, each a cache of {r['cache_limit_bytes']} bytes with {r['homes']} homes per adapter and a file:// origin (= "
         if r.get("homes") else f"{r['nodes']} nodes (1 origin, {r['nodes'] - 1} caches of {r['cache_limit_bytes']} bytes = ")
        + f"{100 * r['cache_limit_bytes'] / r['total_bytes']:.0f}% of {r['total_bytes']}), {r['adapters']} adapters, "
        f"{r['requests']} requests Zipf({r['zipf']:g}) seed {r['seed']}, {r['in_flight']} in flight: {r['seconds']:.1f} s",
        "",
        "| node | requests | hit ratio | LRU simulation | difference (points) | evictions |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["per_node"]:
        diff = 100 * (row["hit_ratio"] - row["lru_ratio"])
        lines.append(f"| {row['node']} | {row['requests']} | {row['hit_ratio']:.3f} | {row['lru_ratio']:.3f} | {diff:+.1f} | {row['evictions']} |")
    worst = max((abs(row["hit_ratio"] - row["lru_ratio"]) for row in r["per_node"]), default=0.0)
    alone = r["alone_median_s"]
    lines += [
        "",
        f"refusals: {r['refusals']} (goal 0); other errors: {sum(r['errors'].values())} {r['errors'] or ''}",
        f"hit ratio vs LRU: worst node {100 * worst:.1f} points apart (goal within 5)",
        f"time to ready on a miss ({r['miss_count']} misses): median {1000 * r['miss_median_s']:.1f} ms "
        f"({r['miss_median_s'] / alone:.2f}x), p99 {1000 * r['miss_p99_s']:.1f} ms ({r['miss_p99_s'] / alone:.2f}x) "
        f"against one pull alone {1000 * alone:.1f} ms",
        f"origin's share of bytes served after warm-up: {100 * r['origin_share_after_warmup']:.1f}% of "
        f"{r['served_bytes_after_warmup']:.0f} bytes, {r['misses_after_warmup']} misses (goal at most 25%)",
        f"complete copies at the end: {r['complete_copies']} of {r['adapters']} adapters ({r['adapters_without_copy']} without one)",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8, help="nodes, the origin node included (3 to 64; with --homes every node is a cache)")
    parser.add_argument("--homes", type=int, default=0, help="placement: homes per adapter among the nodes, the adapters at a file:// --origin "
                        "(0 to --nodes; 0: node 0 holds them and the caches ask every peer)")
    parser.add_argument("--adapters", type=int, default=2000, help="adapters on the origin (10 to 100,000)")
    parser.add_argument("--requests", type=int, default=20000, help="requests in the stream (1 to 1,000,000)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the ranking, the stream and the caches' peer order")
    parser.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s (0 to 3)")
    parser.add_argument("--cache-share", type=float, default=0.10, help="each cache's --max-store-bytes as a share of the origin's bytes (0.01 to 1)")
    parser.add_argument("--in-flight", type=int, default=4, help="requests in flight at once (1 to 64)")
    parser.add_argument("--warmup", type=float, default=0.25, help="the share of the stream before the origin's served bytes are counted (0 to 0.9)")
    parser.add_argument("--baseline", type=int, default=20, help="pulls timed alone before the stream (1 to 1000)")
    parser.add_argument("--jobs", type=int, default=2, help="processes staging the origin's adapters (1 to 16)")
    parser.add_argument("--quick", action="store_true", help=f"the test's size: {QUICK}")
    parser.add_argument("--work", default="/dev/shm/fabric-bench-cache", help="node stores and logs (tmpfs keeps the disk out of the figures)")
    parser.add_argument("--keep", action="store_true", help="leave the work directory (stores, node logs) in place")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the report")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    refuse_out_of_range(parser, ((f"--{name.replace('_', '-')}", getattr(args, name), low, high, why) for name, (low, high, why) in LIMITS.items()))
    if not 0 <= args.homes <= args.nodes:
        parser.error(f"--homes takes 0 (node 0 holds the adapters, the caches ask every peer) to --nodes ({args.nodes}), not {args.homes}")
    return args


def main() -> None:
    args = parse_args()
    result = run(args)
    print(report(result))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
