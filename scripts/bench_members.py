#!/usr/bin/env python
"""A pull on a node that knows members: a Promote naming the only holder, beside the same Promote naming it alone.

Every node of a cluster knows its members, so a Promote naming a peer pulls as a swarm with them (at most
``swarm.SWARM_PEERS``). When the named peer is the only holder and nobody else pulls the adapter, the pull should
cost what naming the peer alone costs (``named_peer_only``): the physical limit here is that same pull with no members.

Nodes: a seeder (``--model none``) holding the 84 MB adapter of ``bench_promote`` (Llama-3-8B shapes, r=16, bf16),
``--members`` idle member nodes that hold nothing, and a store-only receiver whose ``--peers`` names them all.
In interleaved rounds the receiver's client times:

  naming the seeder    a stage-only Promote (NodeClient.pull) naming the seeder: a swarm pull with the members
  named peer only      the same with named_peer_only: the seeder alone (the baseline)

each followed by an unstage, so every round moves the bytes again. ``--baseline REV`` runs the same nodes from a git
revision of this repository in turn with this tree's (the client stays this tree's).

Usage:  .venv/bin/python scripts/bench_members.py [--members 6] [--rounds 8] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_promote import ADAPTER_ID, make_llama3_adapter  # scripts/: this script's folder is on sys.path

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.baseline import baseline_env, refuse_unknown_revision
from adapter_fabric.harness.cluster import LocalNode, start_all, stop_all
from adapter_fabric.harness.flag_bounds import refuse_out_of_range
from adapter_fabric.store import AdapterStore

ROOT = Path(__file__).resolve().parent.parent


def pull_ms(client: NodeClient, seeder: str, named_peer_only: bool) -> float:
    """Milliseconds for the receiver to pull the adapter naming ``seeder``; then it forgets it (bytes and all)."""
    t0 = time.perf_counter()
    reply = client.pull(ADAPTER_ID, peer=seeder, named_peer_only=named_peer_only)
    seconds = time.perf_counter() - t0
    assert reply.bytes_transferred > 0, reply
    client.unstage(ADAPTER_ID)
    return seconds * 1e3


def run_tree(label: str, work: Path, adapter: Path, members: int, rounds: int, env: dict[str, str] | None) -> dict[str, list[float]]:
    """Start the nodes (from ``env``'s package when given), time ``rounds`` interleaved rounds, stop them."""
    AdapterStore(work / "seeder").stage(adapter, ADAPTER_ID)
    seeder = LocalNode(work / "seeder", model="none", env=env)
    idle = [LocalNode(work / f"member{i}", model="none", env=env) for i in range(members)]
    start_all([seeder, *idle])
    receiver = LocalNode(work / "receiver", model="none", env=env, peers=[seeder.address, *(m.address for m in idle)])
    times: dict[str, list[float]] = {"named": [], "only": []}
    try:
        receiver.start()
        with NodeClient(receiver.address) as client:
            pull_ms(client, seeder.address, False), pull_ms(client, seeder.address, True)  # warm-up
            for round_ in range(rounds):
                times["named"].append(pull_ms(client, seeder.address, False))
                times["only"].append(pull_ms(client, seeder.address, True))
                print(f"{label}: round {round_ + 1}/{rounds}: {times['named'][-1]:.0f} ms naming the seeder, {times['only'][-1]:.0f} ms alone",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        stop_all([receiver, *idle, seeder])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=6, help="idle member nodes the receiver knows (1 to 32)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds, each pulling the 84 MB adapter twice (1 to 1000)")
    parser.add_argument("--baseline", default="", help="a git revision: its nodes run in turn with this tree's")
    args = parser.parse_args()
    refuse_out_of_range(parser, (
        ("--members", args.members, 1, 32, "idle nodes, each a process beside the seeder and the receiver"),
        ("--rounds", args.rounds, 1, 1000, "each round moves the 84 MB adapter twice"),
    ))  # fmt: skip
    refuse_unknown_revision(parser, ROOT, args.baseline)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_members_") as tmp:
        tmp = Path(tmp)
        adapter = make_llama3_adapter(tmp / "adapter")
        trees: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
        if args.baseline:
            os.environ["FABRIC_HARNESS_FORK"] = "0"  # forked nodes would run this tree's package: each starts by python -m
            trees.insert(0, (f"baseline {args.baseline}", baseline_env(ROOT, args.baseline, tmp / "baseline")))
        results = {label: run_tree(label, tmp / f"tree{i}", adapter, args.members, args.rounds, env) for i, (label, env) in enumerate(trees)}
    print(f"84 MB adapter (Llama-3-8B shapes, r=16, bf16); a receiver knowing {args.members} idle members; {args.rounds} interleaved rounds; "
          f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(f"{'tree':<28}{'naming the seeder ms':>22}{'named peer only ms':>20}{'ratio':>8}")
    for label, times in results.items():
        named, only = statistics.median(times["named"]), statistics.median(times["only"])
        print(f"{label:<28}{named:>22.1f}{only:>20.1f}{named / only:>8.2f}")


if __name__ == "__main__":
    main()
