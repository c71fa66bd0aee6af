#!/usr/bin/env python
"""Origins benchmark: the time from a miss to a ready adapter, per origin kind, beside one pull of it from a peer.

Every row is real processes on loopback: a store-only node (``--model none``) holding nothing, asked
``fabric pull NODE --id ID`` without ``--from`` (a Promote with stage_only and no peer), timed at the client
until the node answers, the adapter committed and exported-ready (fetched, every Stage check, staged by
content). Between rounds the node unstages the id, so each round is a miss again.

  file://   a directory on the same disk
  http://   nginx (Debian's package; skipped, saying so, when it is absent)
  s3://     moto's S3-compatible server (its own process; Python, so slower than S3 itself would be here)
  hf://     a Hub endpoint (fabric.harness.origin_servers) read through huggingface_hub
  peer      the baseline: the same node pulls the same adapter from a seed node (gRPC and the data channel)

Usage:  .venv/bin/python scripts/bench_origins.py [--size-mib 64] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.harness import origin_servers as servers
from adapter_fabric.harness.flag_bounds import refuse_out_of_range

ID = "bench/origin"


def timed_misses(node: LocalNode, rounds: int, peer: str = "") -> list[float]:
    times = []
    with node.client(timeout=600) as client:
        for _ in range(rounds):
            started = time.perf_counter()
            client.pull(ID, peer=peer)
            times.append(time.perf_counter() - started)
            client.unstage(ID)
    return times


def run(args: argparse.Namespace) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-origins-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        adapter = make_adapter(root / "adapter", args.size_mib)
        size = sum(p.stat().st_size for p in adapter.iterdir())
        www = root / "www" / ID
        shutil.copytree(adapter, www)
        origins: dict[str, tuple[str, dict]] = {"file://": (f"file://{root / 'www'}", {})}
        try:
            url = stack.enter_context(servers.nginx(root / "www", root / "nginx"))
            origins["http:// (nginx)"] = (url, {})
        except servers.ServerMissing as exc:
            print(f"http:// skipped: {exc}")
        try:
            endpoint = stack.enter_context(servers.moto_s3())
            client = servers.s3_client(endpoint)
            client.create_bucket(Bucket="bench")
            servers.put_adapter_s3(client, "bench", f"p/{ID}", adapter)
            origins["s3:// (moto)"] = ("s3://bench/p", {**servers.S3_ENV, "AWS_ENDPOINT_URL": endpoint})
        except servers.ServerMissing as exc:
            print(f"s3:// skipped: {exc}")
        hub_url, repos = stack.enter_context(servers.hub_endpoint(root / "hub"))
        repos.publish(ID, adapter)
        origins["hf:// (Hub endpoint)"] = ("hf://", {"HF_ENDPOINT": hub_url})

        seed = stack.enter_context(LocalNode(root / "seed", model="none", port=free_port()))
        with seed.client() as client:
            client.stage(adapter, ID)
        puller = stack.enter_context(LocalNode(root / "puller", model="none", port=free_port()))
        results["peer pull (baseline)"] = {"seconds": timed_misses(puller, args.rounds, peer=seed.address)}
        for kind, (uri, env) in origins.items():
            node = LocalNode(root / f"n-{len(results)}", model="none", port=free_port(), extra_args=["--origin", uri], env=env).start()
            try:
                results[kind] = {"seconds": timed_misses(node, args.rounds)}
            finally:
                node.stop()
    base = statistics.median(results["peer pull (baseline)"]["seconds"])
    for row in results.values():
        row["median_s"] = statistics.median(row["seconds"])
        row["mb_per_s"] = size / row["median_s"] / 1e6
        row["x_peer_pull"] = row["median_s"] / base
    return {"size_bytes": size, "rounds": args.rounds, "rows": results}


def report(result: dict) -> str:
    lines = [f"miss to ready, {result['size_bytes'] / 1e6:.1f} MB adapter, median of {result['rounds']} rounds:",
             f"  {'source':24} {'median':>9} {'MB/s':>8} {'x peer pull':>12}"]  # fmt: skip
    for kind, row in result["rows"].items():
        lines.append(f"  {kind:24} {row['median_s']:>8.3f}s {row['mb_per_s']:>8.0f} {row['x_peer_pull']:>11.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64, help="the adapter's size (1 to 2048)")
    parser.add_argument("--rounds", type=int, default=5, help="misses timed per origin (1 to 1000)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    refuse_out_of_range(parser, (
        ("--size-mib", args.size_mib, 1, 2048, "every origin and node here holds a copy, on this machine's disk"),
        ("--rounds", args.rounds, 1, 1000, "misses timed per origin, a median"),
    ))
    result = run(args)
    print(report(result))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
