#!/usr/bin/env python
"""Promote benchmark: an 84 MB adapter pulled from a seeder node and landed in a slot, vs a raw socket and vs HTTP.

Side by side, in interleaved rounds, for the same bytes (an adapter with
Llama-3-8B shapes: r=16 on all seven projections of 32 layers, hidden 4096,
intermediate 14336, k/v out 1024, bf16, PEFT tensor names, ~84 MB):

  raw socket     the weights file's bytes over one TCP connection on loopback
                 (sendall / recv_into a pre-touched buffer): the physical baseline
  floor          the same raw socket, received as a promote must at the least
                 (adapter_fabric.harness.receive_floor): each 1 MiB chunk hashed
                 (BLAKE3), written (pwrite) and copied into a pre-touched row,
                 one fsync; one thread, in this process: the physical limit of
                 a verified, durable, staged receive, and its CPU
  Fetch stream   the same bytes as one tuned gRPC Fetch stream (adapter_fabric.transport.wire), no
                 verification, no store: what bench_transfer.py calls "tuned"
  promote        what a node's Promote runs, for real: PeerPuller.pull from a
                 seeder node process (``--model none``) into a fresh AdapterStore
                 (manifest, check against the pool, each chunk verified (BLAKE3)
                 and written once, and copied from the same buffer into the slot
                 row being staged (RowSink), durable commit), then the commit
                 into a slot pool of Llama-3-8B shapes
  two nodes      two real node processes: a store-only receiver's Promote
                 (stage_only, named peer only) pulls from the seeder, each chunk
                 verified, durable commit; timed at the client, RPC included
  HTTP           what a user does without the fabric: nginx (Debian's package)
                 serving the file, ``curl | tee FILE | openssl dgst -sha256``,
                 then ``sync FILE``; skipped, saying so, when nginx is absent

A node with a real Llama-3-8B does not fit this machine, so the receiving side
is a ``ShapeOnlyModel``: the same SlotPool and the same prepare/commit code as
``MultiLoraModel``, with a module-shape table instead of base weights (the base
weights are never read by a promote). It runs in this process, as a node's
worker threads would, with ``wire.tune_malloc()`` as the node's main calls it.

Usage:  .venv/bin/python scripts/bench_promote.py [--rounds 5] [--profile out.prof] [--before]

``--before``: the promote path as it was before stage-while-receiving (pull,
then stage the row from the committed blob), for a side-by-side A/B.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from adapter_fabric.harness.bench import ServerProcess, TransferPath, run_client
from adapter_fabric.transport import wire
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.harness.flag_bounds import refuse_out_of_range
from adapter_fabric.harness.receive_floor import receive_floor
from adapter_fabric.serving.shape_only import LLAMA3_8B, ShapeOnlyModel, llama_module_shapes
from adapter_fabric.store import AdapterStore, PartialDownload
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.pull import PeerPuller

ADAPTER_ID = "bench/llama3-8b-r16"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_llama3_adapter(directory: Path, rank: int = 16, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A PEFT-format LoRA adapter with Llama-3-8B shapes, tensors made in code (no download)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in llama_module_shapes(**LLAMA3_8B).items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(dtype)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B",
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": list(PROJECTIONS),
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


#: ``BENCH_WINDOW`` (the environment): requests a promote keeps outstanding on the seeder, at most this many
MAX_BENCH_WINDOW = 8


def bench_window() -> int | None:
    """``BENCH_WINDOW`` (checked by ``main``), or None when unset: the node's own (``swarm.window_for``)."""
    window = os.environ.get("BENCH_WINDOW", "")
    return int(window) if window else None


class Receiver:
    """The receiving node's promote path, in this process."""

    def __init__(self, workdir: Path, seeder: str, seeder_pid: int, stage_while_receiving: bool = True, data_channel: bool = True) -> None:
        self.workdir = workdir
        self.data_channel = data_channel
        self.stage_while_receiving = stage_while_receiving
        self.seeder = seeder
        self.seeder_pid = seeder_pid
        self.partial_commits: list[float] = []
        _time_partial_commits(self.partial_commits)
        self.model = ShapeOnlyModel.llama3_8b(slots=2, max_rank=16, device="cpu", dtype=torch.bfloat16)
        self.rounds = 0

    def promote(self) -> dict[str, float]:
        """One promote into a fresh store (so the bytes really move); seconds per phase."""
        self.rounds += 1
        root = self.workdir / f"store-{self.rounds}-{int(self.data_channel)}"
        store = AdapterStore(root)
        channels = PeerChannels(data=DataChannels() if self.data_channel else None)  # as a node's pull: the seeder's data channel, or gRPC only
        window = bench_window()  # None: the node's (swarm.window_for)
        puller = PeerPuller(store, channels=channels, window=window)
        model = self.model
        try:
            def check(manifest, signature: bytes) -> None:
                model.check_compatible(manifest.pairs)

            sinks: list = []

            def sink_for(manifest):
                sink = model.row_sink(manifest) if self.stage_while_receiving else None
                sinks.extend([sink] if sink is not None else [])
                return sink

            name = f"r{self.rounds % 3}"
            cpu0, seeder0 = time.process_time(), _process_cpu(self.seeder_pid)
            t0 = time.perf_counter()
            manifest, stats = puller.pull([self.seeder], ADAPTER_ID, check, sink_for)
            t1 = time.perf_counter()
            cpu1, seeder1 = time.process_time(), _process_cpu(self.seeder_pid)
            partial_commit = self.partial_commits[-1] if self.partial_commits else float("nan")
            blob = store.verified_weights(manifest)
            if sinks and sinks[0].complete:
                prepared = model.prepared_from(sinks[0], manifest, blob, name)  # the row was staged as the chunks landed
            else:
                prepared = model.prepare_verified(manifest, blob, name)
            t2 = time.perf_counter()
            try:
                model.commit(prepared)
            finally:
                model.recycle(prepared)
            t3 = time.perf_counter()
            assert stats.bytes_transferred == manifest.weights.size, stats
            return {
                "pull": t1 - t0, "prepare": t2 - t1, "commit": t3 - t2, "total": t3 - t0,
                "pull_cpu": cpu1 - cpu0, "seeder_cpu": seeder1 - seeder0, "partial_commit": partial_commit,
            }  # fmt: skip
        finally:
            puller.channels.close()
            shutil.rmtree(root, ignore_errors=True)

    def prepare_rehashing(self, store_root: Path) -> float:
        """For reference: prepare from a materialized directory (reads a private copy and hashes it again)."""
        store = AdapterStore(store_root)
        view = store.materialize(ADAPTER_ID)
        t0 = time.perf_counter()
        prepared = self.model.prepare(view, "rehash")
        seconds = time.perf_counter() - t0
        self.model.recycle(prepared)
        return seconds


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (clock-tick resolution, 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _time_partial_commits(seconds: list[float]) -> None:
    """Record how long each PartialDownload.commit takes (the pull's tail: whole-file check, sync, install)."""
    commit = PartialDownload.commit

    def timed(self: PartialDownload, adapter_id: str):
        t0 = time.perf_counter()
        try:
            return commit(self, adapter_id)
        finally:
            seconds.append(time.perf_counter() - t0)

    PartialDownload.commit = timed


class Nginx:
    """nginx (the OS package) serving one directory on a loopback port, started with a config of its own."""

    def __init__(self, root: Path, workdir: Path) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        workdir.mkdir(parents=True, exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""  # workers must read a 0700 temp dir
        (workdir / "nginx.conf").write_text(
            f"{user} worker_processes 1; daemon off; error_log {workdir}/error.log; pid {workdir}/nginx.pid;\n"
            "events { worker_connections 64; }\n"
            "http { access_log off; sendfile on; tcp_nopush on; default_type application/octet-stream;\n"
            f"  client_body_temp_path {workdir}/body; proxy_temp_path {workdir}/proxy; fastcgi_temp_path {workdir}/fcgi;\n"
            f"  uwsgi_temp_path {workdir}/uwsgi; scgi_temp_path {workdir}/scgi;\n"
            f"  server {{ listen 127.0.0.1:{self.port}; root {root}; }} }}\n"
        )
        self.process = subprocess.Popen(["nginx", "-p", str(workdir), "-c", str(workdir / "nginx.conf")], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"nginx did not start: {self.process.stderr.read().decode() if self.process.poll() is not None else 'timeout'}")
                time.sleep(0.05)

    def download(self, name: str, out: Path, sha256: str) -> float:
        """Seconds for ``curl | tee FILE | openssl dgst -sha256`` then ``sync FILE``; the digest is checked after the clock."""
        script = f"set -o pipefail; curl -sf http://127.0.0.1:{self.port}/{name} | tee {out} | openssl dgst -sha256 -r > {out}.sha256 && sync {out}"
        t0 = time.perf_counter()
        subprocess.run(["bash", "-c", script], check=True)
        seconds = time.perf_counter() - t0
        got = (out.parent / f"{out.name}.sha256").read_text().split()[0]
        assert got == sha256, f"HTTP download digest {got} != {sha256}"
        out.unlink()
        return seconds

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def two_node_pull(client, seeder: str) -> float:
    """Seconds for a store-only receiver node to pull the adapter from the seeder (Promote stage_only), then forget it."""
    t0 = time.perf_counter()
    reply = client.pull(ADAPTER_ID, peer=seeder, named_peer_only=True)
    seconds = time.perf_counter() - t0
    assert reply.bytes_transferred > 0, reply
    client.unstage(ADAPTER_ID)  # its bytes go too: the next round moves them again
    return seconds


def summarize(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each running every row once (1 to 1000)")
    parser.add_argument("--profile", help="write a cProfile of the promote rounds to this file")
    parser.add_argument("--before", action="store_true", help="stage the slot row after the pull, from the blob (no stage-while-receiving)")
    parser.add_argument("--http-only", action="store_true", help="only the raw socket, two-node and HTTP rows (runs on older trees too)")
    args = parser.parse_args()
    refuse_out_of_range(parser, (("--rounds", args.rounds, 1, 1000, "timed rounds, each moving the 84 MB adapter on every row"),))
    window = os.environ.get("BENCH_WINDOW", "")
    if window and not (window.isascii() and window.isdigit() and 1 <= int(window) <= MAX_BENCH_WINDOW):
        parser.error(f"BENCH_WINDOW takes 1 to {MAX_BENCH_WINDOW} (requests outstanding on the seeder; unset: the node's), not {window!r}")
    wire.tune_malloc()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t_start = time.perf_counter()
    from adapter_fabric.client.node_client import NodeClient

    with tempfile.TemporaryDirectory(prefix="bench_promote_") as tmp:
        tmp = Path(tmp)
        adapter = make_llama3_adapter(tmp / "adapter")
        weights = adapter / "adapter_model.safetensors"
        size = weights.stat().st_size
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        seed_store = tmp / "seeder"
        AdapterStore(seed_store).stage(adapter, ADAPTER_ID)  # staged before the seeder starts
        load_before = os.getloadavg()[0]
        node = LocalNode(seed_store, model="none", log_path=tmp / "seeder.log").start()
        receiver_node = LocalNode(tmp / "receiver", model="none", log_path=tmp / "receiver.log").start()
        nginx = Nginx(adapter, tmp / "nginx") if shutil.which("nginx") else None
        if nginx is None:
            print("HTTP row skipped: nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        raw_row = TransferPath("raw socket", "raw-socket", "raw-socket")
        stream_row = TransferPath("Fetch stream", "wire", "wire", wire.FETCH_CHUNK_SIZE)
        servers = {row.label: ServerProcess(row, str(weights)) for row in (raw_row, stream_row)}
        receiver = None if args.http_only else Receiver(tmp, node.address, node.pid, stage_while_receiving=not args.before)
        grpc_receiver = None if args.http_only else Receiver(tmp, node.address, node.pid, stage_while_receiving=not args.before, data_channel=False)
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
        keys = ("raw", "stream", "pull", "partial_commit", "prepare", "commit", "total", "pull_cpu", "seeder_cpu", "two_nodes", "http",
                "grpc_total", "grpc_pull_cpu", "grpc_seeder_cpu", "floor", "floor_cpu")
        times: dict[str, list[float]] = {key: [] for key in keys}
        client = NodeClient(receiver_node.address)
        floor_row = memoryview(bytearray(b"\x01") * size)  # pre-touched, as a reused staging row is
        try:
            if receiver is not None:
                receiver.promote()  # warm-up: imports, first allocation of the staging row
                grpc_receiver.promote()
            two_node_pull(client, node.address)
            for round_ in range(args.rounds):
                times["raw"].append(run_client(raw_row, servers[raw_row.label].port, size, digest))
                floor_s, floor_cpu = receive_floor(servers[raw_row.label].port, size, floor_row, tmp)
                times["floor"].append(floor_s)
                times["floor_cpu"].append(floor_cpu)
                times["stream"].append(run_client(stream_row, servers[stream_row.label].port, size, digest))
                times["two_nodes"].append(two_node_pull(client, node.address))
                if nginx is not None:
                    times["http"].append(nginx.download(weights.name, tmp / "http-download", digest))
                if receiver is not None:
                    if profiler is not None:
                        profiler.enable()
                    phases = receiver.promote()
                    if profiler is not None:
                        profiler.disable()
                    for key, value in phases.items():
                        times[key].append(value)
                    over_grpc = grpc_receiver.promote()  # the same promote with the seeder's data channel unused: Fetch over gRPC
                    for key in ("total", "pull_cpu", "seeder_cpu"):
                        times[f"grpc_{key}"].append(over_grpc[key])
                print(f"round {round_ + 1}/{args.rounds}" + (f": promote {phases['total'] * 1e3:.0f} ms" if receiver else ""), file=sys.stderr, flush=True)
            rehash = [receiver.prepare_rehashing(seed_store) for _ in range(3)] if receiver is not None else []
        finally:
            client.close()
            for server in servers.values():
                server.close()
            if nginx is not None:
                nginx.close()
            receiver_node.stop()
            node.stop()
        if profiler is not None:
            profiler.dump_stats(args.profile)

    raw_best, raw_median = summarize(times["raw"])
    mode = "http-only" if args.http_only else ("before: row staged from the blob after the pull" if args.before else "stage while receiving")
    print(f"adapter: Llama-3-8B shapes, r=16, 7 projections x 32 layers, bf16, {size / 1e6:.1f} MB weights file; "
          f"{args.rounds} interleaved rounds; {mode}; cpus {os.cpu_count()}; load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"{'row':<48}{'best ms':>9}{'median ms':>11}{'best/raw':>10}{'med/raw':>9}")
    rows = [
        ("raw socket, same bytes", "raw"),
        ("floor: raw + BLAKE3 + write + row copy + fsync", "floor"),
        ("Fetch stream (tuned, no verification)", "stream"),
        ("promote: pull (manifest, verify, store, stage)", "pull"),
        ("  of which the store's commit (check, sync)", "partial_commit"),
        ("promote: prepare (hand over the row)", "prepare"),
        ("promote: commit (slot copy)", "commit"),
        ("promote: total (data channel)", "total"),
        ("promote: total over gRPC Fetch (A/B, same run)", "grpc_total"),
        ("two nodes: stage-only pull, durable", "two_nodes"),
        ("HTTP: nginx, curl | tee | openssl sha256; sync", "http"),
    ]
    for label, key in rows:
        if not times[key]:
            continue
        best, median = summarize(times[key])
        print(f"{label:<48}{best * 1e3:>9.1f}{median * 1e3:>11.1f}{best / raw_best:>10.2f}{median / raw_median:>9.2f}")
    if rehash:
        print(f"{'(reference) prepare from a directory, hashing':<48}{min(rehash) * 1e3:>9.1f}{statistics.median(rehash) * 1e3:>11.1f}")
    goals = []
    if times["total"]:
        # CPU the pull used on each side: with 2 cores, (receiver + seeder) / 2 bounds the pull's time from below
        print(f"pull CPU, median: receiver {statistics.median(times['pull_cpu']) * 1e3:.0f} ms (all threads), "
              f"seeder {statistics.median(times['seeder_cpu']) * 1e3:.0f} ms (10 ms ticks); over gRPC: receiver "
              f"{statistics.median(times['grpc_pull_cpu']) * 1e3:.0f} ms, seeder {statistics.median(times['grpc_seeder_cpu']) * 1e3:.0f} ms; cpus {os.cpu_count()}")
        total = statistics.median(times["total"]) / raw_median
        receiver_cpu = statistics.median(times["pull_cpu"]) * 1e3
        goals += [f"promote total {total:.2f}x raw (goal 2x: {'met' if total <= 2 else 'NOT met'})",
                  f"receiver CPU {receiver_cpu:.0f} ms per pull (goal 60 ms: {'met' if receiver_cpu <= 60 else 'NOT met'})"]
    if times["floor"]:
        floor, floor_cpu = statistics.median(times["floor"]) / raw_median, statistics.median(times["floor_cpu"]) * 1e3
        print(f"the floor (one thread, the four passes a verified durable staged receive needs), median: {floor:.2f}x raw, CPU {floor_cpu:.0f} ms")
    if times["http"]:
        http = statistics.median(times["two_nodes"]) / statistics.median(times["http"])
        goals.append(f"two-node pull {http:.2f}x the HTTP path (goal 0.35x: {'met' if http <= 0.35 else 'NOT met'})")
    print("goals, medians: " + "; ".join(goals) + f"; wall {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
