#!/usr/bin/env python3
"""The physical limit of a swarm rollout on this box: bytes forwarded with the least CPU the kernel allows.

Used by ``bench_swarm.py --ideal`` on the same namespaces and links as the fabric. One forwarder process per
namespace (this file run with ``--forward``, stdlib only): each receives the file from its parent into a file
with ``os.splice`` (socket -> pipe -> file, 1 MiB pipe, ``SO_RCVLOWAT`` so it wakes per 256 KiB) and forwards
what has arrived to its children with ``os.sendfile`` as it lands; the seed sends its file to its children. No
hashing, no framing, no RPC, one connection per link. Topologies: ``chain`` (node i's parent is i - 1: every
link carries the bytes once, so the slowest receiver can finish one pipeline delay after a single transfer) and
``tree2`` (fan-out 2: each parent's upload is split in two).

Measured per run: when each receiver had the whole file (from the seed's start), the forwarders' user and
system CPU from ready to done (os.times in each), and the host's /proc/stat deltas over the run (softirq and
system time outside any process: the veth, bridge and tbf work done in interrupt context). /proc/stat is the
whole host's: other work on the box shows in it too.
"""

from __future__ import annotations

import argparse
import fcntl
import filecmp
import json
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TypeVar

PORT = 50071
PIPE_BYTES = 1 << 20  # /proc/sys/fs/pipe-max-size's default
LOW_MARK = 256 << 10  # wake the receiver per 256 KiB, not per few segments
CONNECT_S = 30.0  # a parent that never listens fails the run instead of hanging it
MAX_SIZE = 4 << 30  # bytes a forwarder moves: bench_swarm.py's adapter is 1 GiB at most
MAX_CHILDREN = 63  # a forwarder's children: bench_swarm.py runs at most 64 nodes


def parent_of(i: int, topology: str) -> int:
    return i - 1 if topology == "chain" else (i - 1) // 2


def children_of(i: int, count: int, topology: str) -> list[int]:
    return [j for j in range(1, count) if parent_of(j, topology) == i]


# ------------------------------------------------------------------ the forwarder: one per namespace


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            return socket.create_connection((host, int(port)))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def forward(args: argparse.Namespace) -> dict:
    size = args.size
    listener = socket.create_server((args.host, PORT), backlog=8)
    parent = None if args.source else _connect(args.parent)
    children = [listener.accept()[0] for _ in range(args.children)]
    listener.close()
    out = os.open(args.source or args.out, os.O_RDONLY if args.source else os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    print(json.dumps({"ready": True}), flush=True)
    start = os.times()
    have = size if args.source else 0
    if args.source:
        sys.stdin.readline()  # the driver's go
    sent = [0] * len(children)
    selector = selectors.DefaultSelector()
    pipe_r = pipe_w = -1
    if parent is not None:
        pipe_r, pipe_w = os.pipe()
        fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        parent.setblocking(False)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(LOW_MARK, size))
        selector.register(parent, selectors.EVENT_READ, -1)
    for child in children:
        child.setblocking(False)

    def want_writes() -> None:  # every child behind the bytes we have wants writing
        for j, child in enumerate(children):
            if sent[j] < have and not _registered(selector, child):
                selector.register(child, selectors.EVENT_WRITE, j)

    want_writes()
    done_at = time.monotonic() if have == size else None
    while have < size or any(s < size for s in sent):
        for key, _ in selector.select():
            k = key.data
            if k == -1:
                try:
                    n = os.splice(parent.fileno(), pipe_w, min(PIPE_BYTES, size - have))
                except BlockingIOError:
                    continue
                if n == 0:
                    raise SystemExit(f"parent closed at {have} of {size} bytes")
                while n:
                    m = os.splice(pipe_r, out, n, offset_dst=have)
                    have, n = have + m, n - m
                if have == size:
                    done_at = time.monotonic()
                    selector.unregister(parent)
                elif size - have < LOW_MARK:
                    parent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size - have)
                want_writes()
                continue
            try:
                sent[k] += os.sendfile(children[k].fileno(), out, sent[k], have - sent[k])
            except BlockingIOError:
                continue
            if sent[k] == have:
                selector.unregister(children[k])
    end = os.times()
    for child in children:
        child.setblocking(True)
        child.shutdown(socket.SHUT_WR)
        child.recv(1)  # the child closes once it has everything
        child.close()
    if parent is not None:
        parent.close()
    os.close(out)
    return {"done_at": done_at, "user_s": end.user - start.user, "system_s": end.system - start.system}


def _registered(selector: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        selector.get_key(sock)
        return True
    except KeyError:
        return False


# ------------------------------------------------------------------ the driver: runs where the namespaces are


def host_cpu_s() -> dict[str, float]:
    """The host's CPU seconds by kind so far, from /proc/stat's first line (all cores together)."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    values = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    tick = os.sysconf("SC_CLK_TCK")
    return {name: int(v) / tick for name, v in zip(names, values, strict=True)}


T = TypeVar("T", int, float)


def deltas(before: dict[str, T], after: dict[str, T]) -> dict[str, T]:
    """What each counter (CPU seconds, packets) gained between two readings."""
    return {k: after[k] - before[k] for k in before}


def format_net(net: dict[str, int]) -> str:
    """The links' packet counters over a run (``NetLab.counters``)."""
    return (
        f"packets through the links' tbf qdiscs: {net['qdisc_packets']:,} ({net['qdisc_dropped']:,} dropped, {net['qdisc_overlimits']:,} held back); "
        f"TCP segments: {net['tcp_out']:,} out, {net['tcp_in']:,} in, {net['tcp_retrans']:,} retransmitted "
        f"({net['tcp_loss_probes']:,} tail-loss probes, {net['tcp_dsack_recv']:,} reported needless); "
        f"{net['tcp_delayed_acks']:,} delayed ACKs"
    )


def run(lab, receivers: int, topology: str, source: Path, work: Path) -> dict:
    """Forward ``source`` from node 0 to nodes 1..receivers of ``lab`` (already up); when each had it, and the CPU."""
    size = source.stat().st_size
    count = receivers + 1
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    procs = []
    try:
        for i in range(count):
            where = ["--source", str(source)] if i == 0 else ["--parent", f"{lab.node_ip(parent_of(i, topology))}:{PORT}", "--out", str(work / f"n{i}")]
            command = [*lab.exec_prefix(lab.node_ns(i)), sys.executable, str(Path(__file__).resolve()), "--forward", "--host", lab.node_ip(i),
                       "--size", str(size), "--children", str(len(children_of(i, count, topology))), *where]  # fmt: skip
            procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for proc in procs:
            if json.loads(proc.stdout.readline() or "{}").get("ready") is not True:
                raise SystemExit(f"ideal {topology}: a forwarder failed to start (exit {proc.wait()})")
        net_before = lab.counters(proc.pid for proc in procs)
        host_before, start = host_cpu_s(), time.monotonic()
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        reports = [json.loads(proc.stdout.readline() or "null") for proc in procs]
        wall, host = time.monotonic() - start, deltas(host_before, host_cpu_s())
        net = deltas(net_before, lab.counters(proc.pid for proc in procs))  # while the forwarders live: their namespaces' counters are read through them
        for proc in procs:
            proc.stdin.close()  # now they may exit
        for proc in procs:
            if proc.wait(timeout=30) != 0 or None in reports:
                raise SystemExit(f"ideal {topology}: a forwarder failed (exit {proc.returncode})")
        seconds = sorted(r["done_at"] - start for r in reports[1:])
        intact = all(filecmp.cmp(source, work / f"n{i}", shallow=False) for i in range(1, count))
        return {
            "mode": f"ideal {topology}" if receivers > 1 else "ideal single", "nodes": receivers, "size": size, "intact": intact,
            "slowest_s": seconds[-1], "median_s": seconds[len(seconds) // 2], "fastest_s": seconds[0],
            "cpu_s": {"user": sum(r["user_s"] for r in reports), "system": sum(r["system_s"] for r in reports), "wall": wall, "host": host},
            "net": net,
        }  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        subprocess.run(["rm", "-rf", str(work)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward", action="store_true", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--children", type=int, required=True)
    parser.add_argument("--source", default="", help="the seed: the file to send")
    parser.add_argument("--parent", default="", help="a receiver: host:port to receive from")
    parser.add_argument("--out", default="", help="a receiver: where the bytes land")
    args = parser.parse_args()
    if not 1 <= args.size <= MAX_SIZE:
        parser.error(f"--size takes 1 to {MAX_SIZE} (bytes of the file to forward), not {args.size}")
    if not 0 <= args.children <= MAX_CHILDREN:
        parser.error(f"--children takes 0 to {MAX_CHILDREN} (forwarders this one sends to), not {args.children}")
    if bool(args.source) == bool(args.parent) or bool(args.parent) != bool(args.out):
        parser.error("--forward takes --source (the seed) or --parent and --out (a receiver)")
    if args.source and not os.path.isfile(args.source):
        parser.error(f"--source takes the file to send, not {args.source!r}")
    print(json.dumps(forward(args)), flush=True)
    sys.stdin.readline()  # the driver reads this namespace's counters through us first, then closes our stdin


if __name__ == "__main__":
    main()
