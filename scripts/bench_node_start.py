#!/usr/bin/env python3
"""Node start-up: a node forked from the harness's pre-imported server against one started by ``python -m``.

Starts ``--nodes`` tiny-model nodes each way, in turn (one forked, one by ``python -m``, and so on), and reports the
median wall time from launch to health SERVING, the node process's CPU seconds by then (its own, from /proc;
a forked node's count starts at its fork) and the wall time of its graceful stop (SIGTERM until it exited). The
fork server's own start-up (its imports, once per environment) is reported apart.

    python scripts/bench_node_start.py --nodes 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapter_fabric.harness import node_forks
from adapter_fabric.harness.cluster import LocalNode


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(root: Path, name: str, forked: bool) -> tuple[float, float, float]:
    os.environ[node_forks.FORK_VARIABLE] = "1" if forked else "0"
    node = LocalNode(root / name, model="tiny")
    began = time.perf_counter()
    node.start()
    seconds = time.perf_counter() - began
    cpu = _cpu_seconds(node.pid)
    began = time.perf_counter()
    node.stop()
    return seconds, cpu, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5, help="nodes started each way (1-50)")
    args = parser.parse_args()
    if not 1 <= args.nodes <= 50:
        parser.error(f"--nodes takes 1 to 50 (tiny-model nodes started each way, one after another), not {args.nodes}")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-node-start-") as tmp:
        root = Path(tmp)
        began = time.perf_counter()
        _start(root, "warm-up", forked=True)  # the fork server's imports, once
        server_seconds = time.perf_counter() - began
        rows: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for i in range(args.nodes):
            for forked in (True, False):
                rows[forked].append(_start(root, f"n{i}-{int(forked)}", forked))
    print(f"tiny-model nodes, {args.nodes} each way, interleaved; cpus {os.cpu_count()}; load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"fork server's start (its imports, once per environment), with its first node: {server_seconds:.2f} s")
    print(f"{'start':40} {'to SERVING, median s':>22} {'node CPU s, median':>20} {'stop, median s':>16}")
    medians = {}
    for forked, label in ((False, "python -m adapter_fabric.node.main"), (True, "forked from the server")):
        wall, cpu, stop = (statistics.median(r[i] for r in rows[forked]) for i in range(3))
        medians[forked] = (wall, cpu)
        print(f"{label:40} {wall:22.3f} {cpu:20.2f} {stop:16.3f}")
    print(f"forked over python -m: {medians[True][0] / medians[False][0]:.3f}x the wall, {medians[True][1] / max(medians[False][1], 0.01):.3f}x the CPU")


if __name__ == "__main__":
    sys.exit(main())
