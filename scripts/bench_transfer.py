#!/usr/bin/env python
"""Transfer benchmark: how fast one Fetch stream moves bytes between two processes on loopback.

Side by side, for one payload of random bytes (default 256 MiB):

  raw-socket       TCP sendall / recv_into a preallocated buffer: the physical baseline
  grpc-default     generated stubs, fabric_pb2.Chunk messages, default channel/server options
  tuned            fabric.wire: hand-encoded chunks, raw-bytes handler and stub, tuned options
  tuned+sha256     the same, hashing every 1 MiB on the receiving side (as a pulling node does)

plus sweeps: Fetch chunk size, tuned codec with default options (what the options
buy), a sync client instead of grpc.aio. Every server runs in its own process
(spawned with this script's --serve), the client in this one; the receiving side
always lands the bytes in a preallocated buffer, as a store write would.
A single stream throughout: no parallel streams.

Usage:  .venv/bin/python scripts/bench_transfer.py [--mib 256] [--reps 3] [--quick]
Prints MB/s (10**6 bytes/s) and the ratio to the raw socket. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


# ------------------------------------------------------------------ servers


def _serve(mode: str, payload_path: str, chunk_size: int, options: list) -> None:
    """Runs in the server process: print the port, then serve until stdin closes."""
    payload = Path(payload_path).read_bytes()
    if mode == "tuned":
        from fabric import wire

        wire.tune_malloc()
    if mode == "raw-socket":
        _serve_raw_socket(payload)
    else:
        asyncio.run(_serve_grpc(mode, payload, chunk_size, options))


def _serve_raw_socket(payload: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    view = memoryview(payload)
    while True:
        conn, _ = listener.accept()
        with conn:
            if not conn.recv(1):  # the client's "go" byte; empty = shut down
                return
            conn.sendall(view)


async def _serve_grpc(mode: str, payload: bytes, chunk_size: int, options: list) -> None:
    import grpc

    from fabric import wire
    from fabric.v1 import fabric_pb2, fabric_pb2_grpc

    view = memoryview(payload)

    def byte_range(request: Any) -> range:
        end = len(payload) if request.length == 0 else min(len(payload), request.offset + request.length)
        return range(request.offset, end, chunk_size)

    class Servicer(fabric_pb2_grpc.FabricServicer):
        async def Fetch(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            if mode == "grpc-default":
                # What generated code invites: slice (a copy), then the message copies again.
                for offset in byte_range(request):
                    yield fabric_pb2.Chunk(offset=offset, data=payload[offset : offset + chunk_size])
            else:
                for offset in byte_range(request):
                    yield wire.encode_chunk(offset, view[offset : offset + chunk_size])

    server = grpc.aio.server(options=[tuple(o) for o in options])
    if mode == "grpc-default":
        fabric_pb2_grpc.add_FabricServicer_to_server(Servicer(), server)
    else:
        wire.add_fabric_servicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closes stdin to stop us
    await server.stop(None)


class ServerProcess:
    """A server in a child process (a real process, as a peer node is)."""

    def __init__(self, mode: str, payload_path: str, chunk_size: int = MIB, options: Sequence = ()) -> None:
        argv = [sys.executable, __file__, "--serve", mode, "--payload", payload_path, "--chunk", str(chunk_size)]
        argv += ["--options", json.dumps(list(options))]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server {mode} exited before listening (rc={self.proc.wait()})")
        self.port = int(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ clients
# Each returns the seconds one full transfer took, after checking the bytes.


def _check(buf: bytearray, expected_digest: bytes) -> None:
    if hashlib.sha256(buf).digest() != expected_digest:
        raise SystemExit("received bytes differ from the payload")


def client_raw_socket(port: int, size: int, out: bytearray) -> float:
    view = memoryview(out)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < size:
            n = sock.recv_into(view[got:], size - got)
            if n == 0:
                raise SystemExit(f"raw socket closed after {got} bytes")
            got += n
        return time.perf_counter() - start


def _shutdown_raw_socket(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)):
        pass


async def client_grpc_aio(port: int, size: int, out: bytearray, kind: str, options: Sequence, reps: int) -> list[float]:
    import grpc

    from fabric import wire
    from fabric.v1 import fabric_pb2, fabric_pb2_grpc

    view = memoryview(out)
    times = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        if kind == "generated":
            fetch = fabric_pb2_grpc.FabricStub(channel).Fetch
        else:
            fetch = wire.fetch_stub(channel)
        await channel.channel_ready()
        for _ in range(reps):
            start = time.perf_counter()
            got = 0
            async for message in fetch(fabric_pb2.FetchRequest(digest="bench")):
                if kind == "generated":
                    offset, data = message.offset, message.data
                else:
                    offset, data = message
                n = len(data)
                view[offset : offset + n] = data
                if kind == "sha256":
                    # A pulling node checks every chunk before it counts as received.
                    hashlib.sha256(data).digest()
                got += n
            times.append(time.perf_counter() - start)
            if got != size:
                raise SystemExit(f"{kind}: got {got} of {size} bytes")
    return times


def client_grpc_sync(port: int, size: int, out: bytearray, options: Sequence, reps: int) -> list[float]:
    import grpc

    from fabric import wire
    from fabric.v1 import fabric_pb2

    view = memoryview(out)
    times = []
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        fetch = wire.fetch_stub(channel)
        for _ in range(reps):
            start = time.perf_counter()
            got = 0
            for offset, data in fetch(fabric_pb2.FetchRequest(digest="bench")):
                view[offset : offset + len(data)] = data
                got += len(data)
            times.append(time.perf_counter() - start)
            if got != size:
                raise SystemExit(f"sync: got {got} of {size} bytes")
    return times


# ------------------------------------------------------------------ driver


class Bench:
    def __init__(self, payload_path: str, size: int, digest: bytes, reps: int) -> None:
        self.payload_path, self.size, self.digest, self.reps = payload_path, size, digest, reps
        self.out = bytearray(size)
        self.rows: list[tuple[str, list[float]]] = []

    def record(self, label: str, times: list[float]) -> None:
        _check(self.out, self.digest)
        self.out[:] = bytes(self.size)  # the next run must really land every byte
        self.rows.append((label, times))
        best = self.size / min(times) / 1e6
        print(f"  {label:<44} best {best:8.0f} MB/s  runs {[round(self.size / t / 1e6) for t in times]}", flush=True)

    def raw_socket(self) -> None:
        with ServerProcess("raw-socket", self.payload_path) as server:
            times = [client_raw_socket(server.port, self.size, self.out) for _ in range(self.reps)]
            _shutdown_raw_socket(server.port)
        self.record("raw socket (sendall / recv_into)", times)

    def grpc(
        self, label: str, mode: str, kind: str, chunk: int, options: Optional[Sequence] = None, sync: bool = False
    ) -> None:
        """``options`` apply to both server and channel; None = fabric.wire's tuned options."""
        from fabric import wire

        if options is None:
            options = wire.CHANNEL_OPTIONS
        with ServerProcess(mode, self.payload_path, chunk, options) as server:
            if sync:
                times = client_grpc_sync(server.port, self.size, self.out, options, self.reps)
            else:
                times = asyncio.run(client_grpc_aio(server.port, self.size, self.out, kind, options, self.reps))
        self.record(label, times)

    def table(self) -> str:
        base = self.size / min(self.rows[0][1])
        lines = [
            f"payload {self.size // MIB} MiB, {self.reps} runs each, best and median; ratio = best / raw socket best",
            f"{'path':<46}{'best MB/s':>10}{'median MB/s':>13}{'ratio':>8}",
        ]
        for label, times in self.rows:
            best = self.size / min(times)
            median = self.size / statistics.median(times)
            lines.append(f"{label:<46}{best / 1e6:>10.0f}{median / 1e6:>13.0f}{best / base:>8.2f}")
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB")
    parser.add_argument("--reps", type=int, default=3, help="timed transfers per path")
    parser.add_argument("--quick", action="store_true", help="headline paths only, no sweeps")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=MIB, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.payload, args.chunk, json.loads(args.options))
        return

    from fabric import wire

    size = args.mib * MIB
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_transfer_") as tmp:
        payload_path = os.path.join(tmp, "payload.bin")
        payload = os.urandom(size)
        Path(payload_path).write_bytes(payload)
        digest = hashlib.sha256(payload).digest()
        del payload
        bench = Bench(payload_path, size, digest, args.reps)
        cs = wire.FETCH_CHUNK_SIZE
        print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, chunk {cs // 1024} KiB", flush=True)
        bench.raw_socket()
        bench.grpc(f"grpc default (pb2.Chunk, default opts) {cs // 1024}K", "grpc-default", "generated", cs, ())
        bench.grpc(f"tuned (fabric.wire, aio) {cs // 1024}K", "tuned", "raw", cs)
        bench.grpc(f"tuned + sha256 per chunk {cs // 1024}K", "tuned", "sha256", cs)
        if not args.quick:
            for chunk in (256 << 10, 2 * MIB, 4 * MIB):
                if chunk != cs:
                    bench.grpc(f"tuned, chunk {chunk // 1024}K", "tuned", "raw", chunk)
            bench.grpc(f"fabric.wire codec, default opts {cs // 1024}K", "tuned", "raw", cs, options=())
            bench.grpc(f"tuned, sync client {cs // 1024}K", "tuned", "raw", cs, sync=True)
            bench.grpc(f"generated stub vs fabric.wire server {cs // 1024}K", "tuned", "generated", cs)
    print()
    print(bench.table())
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
