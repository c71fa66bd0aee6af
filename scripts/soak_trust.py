#!/usr/bin/env python3
"""A bounded soak of one node: promotes, pulls and generations with deadlines; prints its memory, fds and threads.

    .venv/bin/python scripts/soak_trust.py --seconds 60

Two real node processes (a seed holding four adapters, and the node under
test with two slots and the seed as its peer). For ``--seconds``, three
threads run against the node: promotes cycling the four adapters (evictions),
unstage + stage-only pulls from the seed, and generations whose deadlines
pass mid-generation (cancelled server-side) beside short ones that finish.
Every 5 s it samples the node's RSS, open fds and threads from /proc; at the
end it prints the samples after warm-up and the counts of each operation.
Not part of the test run (it takes minutes); the figures go in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import grpc

from adapter_fabric.errors import FabricError
from adapter_fabric.harness.cluster import LocalCluster
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

PROMPT = [3, 14, 15, 92, 65, 35]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sample(pid: int) -> tuple[int, int, int]:
    """(RSS KiB, open fds, threads) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the three threads run (1 to 86400)")
    args = parser.parse_args()
    if not 1 <= args.seconds <= 86_400:  # NaN too: no comparison holds
        parser.error(f"--seconds takes 1 to 86400 (a soak of a day at most), not {args.seconds}")
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    base = build_tiny_model()
    dirs = {f"s{i}": make_peft_adapter(root / f"a{i}", base_model=base, r=8, lora_alpha=16, target_modules=ALL, seed=40 + i) for i in range(4)}
    counts = {"promote": 0, "pull": 0, "generate": 0, "cancelled": 0}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    with LocalCluster(root / "cluster", 2, slots=2, extra_args=["--chunk-size", "4096"]) as cluster:
        seed, node = cluster.nodes
        with seed.client() as client:
            for adapter_id, directory in dirs.items():
                client.stage(directory, adapter_id)
        stop = time.monotonic() + args.seconds

        def promotes() -> None:
            with node.client() as client:
                i = 0
                while time.monotonic() < stop:
                    try:
                        client.promote(f"s{i % 4}", peer=seed.address)
                        count("promote")
                    except FabricError as exc:
                        count(f"error:{type(exc).__name__}")
                    i += 1

        def pulls() -> None:
            with node.client() as client:
                while time.monotonic() < stop:
                    try:
                        client.unstage("s3")
                    except FabricError:
                        pass
                    try:
                        client.promote("s3", peer=seed.address, stage_only=True)
                        count("pull")
                    except FabricError as exc:
                        count(f"error:{type(exc).__name__}")

        def generations() -> None:
            with grpc.insecure_channel(node.address) as channel:
                stub = fabric_pb2_grpc.FabricStub(channel)
                while time.monotonic() < stop:
                    try:  # a deadline that passes mid-generation, then one that does not
                        stub.Generate(fabric_pb2.GenerateRequest(use_base=True, input_ids=PROMPT, max_new_tokens=120), timeout=0.05)
                        count("generate")
                    except grpc.RpcError as exc:
                        count("cancelled" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"error:{exc.code().name}")
                    try:
                        stub.Generate(fabric_pb2.GenerateRequest(use_base=True, input_ids=PROMPT, max_new_tokens=4), timeout=60)
                        count("generate")
                    except grpc.RpcError as exc:
                        count(f"error:{exc.code().name}")

        threads = [threading.Thread(target=f) for f in (promotes, pulls, generations)]
        for t in threads:
            t.start()
        samples = []
        while time.monotonic() < stop:
            samples.append((round(args.seconds - (stop - time.monotonic())), *sample(node.pid)))
            time.sleep(5.0)
        for t in threads:
            t.join()
        samples.append((round(args.seconds), *sample(node.pid)))
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print("t_s  rss_kib  fds  threads")
    for t, rss, fds, threads_ in samples:
        print(f"{t:>4} {rss:>8} {fds:>4} {threads_:>8}")
    warm = samples[len(samples) // 4:]  # after warm-up
    print(f"after warm-up: rss {min(s[1] for s in warm)}..{max(s[1] for s in warm)} KiB, "
          f"fds {min(s[2] for s in warm)}..{max(s[2] for s in warm)}, threads {min(s[3] for s in warm)}..{max(s[3] for s in warm)}")
    print(" ".join(f"{k}={v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
