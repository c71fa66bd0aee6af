#!/usr/bin/env python
"""Transfer benchmark: how fast one Fetch stream moves bytes between two processes on loopback.

Side by side, for one payload of random bytes (default 256 MiB):

  raw socket       TCP sendall / recv_into a preallocated buffer: the physical baseline
  grpc default     generated stubs, fabric_pb2.Chunk messages, default gRPC options
  tuned            fabric.transport.wire: hand-encoded chunks, raw-bytes handler and stub, tuned
                   options, wire.tune_malloc() in both processes
  tuned + BLAKE3   the same, hashing every chunk on the receiving side as a pulling node does
                   (digest scheme 2: the one verification pass)
  tuned + sha256   the same with sha256, as digest scheme 1 did (in the event loop, or in a
                   worker thread overlapping the next receive); kept as the reference

plus what each piece buys (tuned without tune_malloc; with default gRPC options)
and sweeps: Fetch chunk size, a sync client instead of grpc.aio, the generated
stub as client. A single stream throughout: no parallel streams.

Every server is its own process, serving the payload from an mmap of one temp
file (page cache, as a node's store would); every transfer is a fresh client
process with a fresh connection (connection set-up is not timed) that lands the
bytes in a pre-touched buffer and checks their sha256 after the clock stops.
Rounds are interleaved (each round runs every path once) so that load from
other processes on a shared machine spreads over all rows.

Usage:  .venv/bin/python scripts/bench_transfer.py [--mib 256] [--rounds 5] [--quick | --sweep-options]
Prints MB/s (10**6 bytes/s) and the ratio to the raw socket. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from blake3 import blake3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


@dataclasses.dataclass
class Path_:
    """One row of the table: a server process and how each client transfer runs."""

    label: str
    server: str  # "raw-socket" | "grpc-default" | "wire"
    client: str  # "raw-socket" | "generated" | "wire" | "wire-blake3" | "wire-sha256" | "wire-sha256-thread" | "wire-sync"
    chunk: int = MIB
    options: Optional[list] = None  # both sides; None = fabric.transport.wire's tuned options
    malloc: bool = True  # wire.tune_malloc() in server and client

    def resolved_options(self) -> list:
        if self.options is not None:
            return self.options
        from fabric.transport import wire

        return [list(o) for o in wire.CHANNEL_OPTIONS]


# ------------------------------------------------------------------ servers


def serve(path: Path_, payload_path: str) -> None:
    """Server process: print the port, serve until stdin closes."""
    if path.malloc and path.server != "raw-socket":
        from fabric.transport import wire

        wire.tune_malloc()
    with open(payload_path, "rb") as f:
        payload = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if path.server == "raw-socket":
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_serve_raw_socket, args=(listener, payload), daemon=True).start()
        print(listener.getsockname()[1], flush=True)
        sys.stdin.read()
    else:
        asyncio.run(_serve_grpc(path, payload))


def _serve_raw_socket(listener: socket.socket, payload: mmap.mmap) -> None:
    view = memoryview(payload)
    while True:
        conn, _ = listener.accept()
        with conn:
            if conn.recv(1):  # the client's "go" byte
                conn.sendall(view)


async def _serve_grpc(path: Path_, payload: mmap.mmap) -> None:
    import grpc

    from fabric.transport import wire
    from fabric.v1 import fabric_pb2, fabric_pb2_grpc

    view = memoryview(payload)
    chunk = path.chunk

    def byte_range(request: Any) -> range:
        end = len(payload) if request.length == 0 else min(len(payload), request.offset + request.length)
        return range(request.offset, end, chunk)

    class Servicer(fabric_pb2_grpc.FabricServicer):
        async def Fetch(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            if path.server == "grpc-default":
                # What generated code invites: slice to bytes, the message copies it again.
                for offset in byte_range(request):
                    yield fabric_pb2.Chunk(offset=offset, data=payload[offset : offset + chunk])
            else:
                for offset in byte_range(request):
                    yield wire.encode_chunk(offset, view[offset : offset + chunk])

    server = grpc.aio.server(options=[tuple(o) for o in path.resolved_options()])
    if path.server == "grpc-default":
        fabric_pb2_grpc.add_FabricServicer_to_server(Servicer(), server)
    else:
        wire.add_fabric_servicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closes stdin to stop us
    await server.stop(None)


class ServerProcess:
    def __init__(self, path: Path_, payload_path: str) -> None:
        argv = [sys.executable, __file__, "--serve", json.dumps(dataclasses.asdict(path)), "--payload", payload_path]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"server for {path.label!r} exited before listening (rc={self.proc.wait()})")
        self.port = int(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ clients


def client(path: Path_, port: int, size: int, digest: str) -> None:
    """Client process: one timed transfer on a fresh connection; print seconds."""
    if path.malloc and path.client != "raw-socket":
        from fabric.transport import wire

        wire.tune_malloc()
    out = bytearray(b"\x01") * size  # pre-touched: page faults on the target are not what we measure
    if path.client == "raw-socket":
        seconds = _client_raw_socket(port, size, out)
    elif path.client == "wire-sync":
        seconds = _client_sync(path, port, size, out)
    else:
        seconds = asyncio.run(_client_aio(path, port, size, out))
    if hashlib.sha256(out).hexdigest() != digest:
        raise SystemExit(f"{path.label}: received bytes differ from the payload")
    print(seconds)


def _client_raw_socket(port: int, size: int, out: bytearray) -> float:
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


async def _client_aio(path: Path_, port: int, size: int, out: bytearray) -> float:
    import grpc

    from fabric.transport import wire
    from fabric.v1 import fabric_pb2, fabric_pb2_grpc

    view = memoryview(out)
    request = fabric_pb2.FetchRequest(digest="bench")
    got = 0
    options = [tuple(o) for o in path.resolved_options()]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        await channel.channel_ready()
        start = time.perf_counter()
        if path.client == "generated":
            async for chunk in fabric_pb2_grpc.FabricStub(channel).Fetch(request):
                view[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
                got += len(chunk.data)
        elif path.client == "wire-sha256-thread":
            # Hash in a worker thread (hashlib drops the GIL) while the loop receives.
            loop = asyncio.get_running_loop()
            pending: collections.deque = collections.deque()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                async for offset, data in wire.fetch_stub(channel)(request):
                    n = len(data)
                    view[offset : offset + n] = data
                    pending.append(loop.run_in_executor(pool, _sha256, data))
                    if len(pending) > 4:
                        await pending.popleft()
                    got += n
                for future in pending:
                    await future
        else:
            check = {"wire-sha256": lambda d: hashlib.sha256(d).digest(), "wire-blake3": lambda d: blake3(d).digest()}.get(path.client)
            async for offset, data in wire.fetch_stub(channel)(request):
                n = len(data)
                view[offset : offset + n] = data
                if check is not None:
                    check(data)  # a pulling node checks every chunk
                got += n
        seconds = time.perf_counter() - start
    if got != size:
        raise SystemExit(f"{path.label}: got {got} of {size} bytes")
    return seconds


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _client_sync(path: Path_, port: int, size: int, out: bytearray) -> float:
    import grpc

    from fabric.transport import wire
    from fabric.v1 import fabric_pb2

    view = memoryview(out)
    got = 0
    options = [tuple(o) for o in path.resolved_options()]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        start = time.perf_counter()
        for offset, data in wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="bench")):
            view[offset : offset + len(data)] = data
            got += len(data)
        seconds = time.perf_counter() - start
    if got != size:
        raise SystemExit(f"{path.label}: got {got} of {size} bytes")
    return seconds


def run_client(path: Path_, port: int, size: int, digest: str) -> float:
    argv = [sys.executable, __file__, "--client", json.dumps(dataclasses.asdict(path))]
    argv += ["--port", str(port), "--bytes", str(size), "--digest", digest]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"client for {path.label!r} failed (rc={done.returncode})")
    return float(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver


def option_sweep() -> list[Path_]:
    """--sweep-options: gRPC options that were candidates for wire.CHANNEL_OPTIONS."""
    from fabric.transport import wire

    cs = wire.FETCH_CHUNK_SIZE
    msg = [["grpc.max_send_message_length", 64 * MIB], ["grpc.max_receive_message_length", 64 * MIB]]
    nobdp = [["grpc.http2.bdp_probe", 0]]
    candidates = {
        "none (grpc defaults)": [],
        "msg sizes only": msg,
        "msg + window 1M, no bdp": msg + [["grpc.http2.lookahead_bytes", 1 * MIB]] + nobdp,
        "msg + window 4M, no bdp": msg + [["grpc.http2.lookahead_bytes", 4 * MIB]] + nobdp,
        "msg + window 16M, no bdp": msg + [["grpc.http2.lookahead_bytes", 16 * MIB]] + nobdp,
        "msg + window 16M, bdp": msg + [["grpc.http2.lookahead_bytes", 16 * MIB]],
        "msg + max frame 16M": msg + [["grpc.http2.max_frame_size", 16 * MIB - 1]],
        "msg + write buffer 8M": msg + [["grpc.http2.write_buffer_size", 8 * MIB]],
    }
    rows = [Path_("raw socket (sendall / recv_into)", "raw-socket", "raw-socket")]
    rows += [Path_(f"opts: {name}", "wire", "wire", cs, options=opts) for name, opts in candidates.items()]
    return rows


def paths(quick: bool) -> list[Path_]:
    from fabric.transport import wire

    cs = wire.FETCH_CHUNK_SIZE
    k = f"{cs // 1024}K"
    rows = [
        Path_("raw socket (sendall / recv_into)", "raw-socket", "raw-socket"),
        Path_(f"grpc default (pb2.Chunk, default opts) {k}", "grpc-default", "generated", cs, options=[], malloc=False),
        Path_(f"tuned (fabric.transport.wire, aio client) {k}", "wire", "wire", cs),
        Path_(f"tuned + BLAKE3 per chunk {k}", "wire", "wire-blake3", cs),
        Path_(f"tuned + sha256 per chunk {k}", "wire", "wire-sha256", cs),
        Path_(f"tuned + sha256 per chunk in a thread {k}", "wire", "wire-sha256-thread", cs),
    ]
    if quick:
        return rows
    rows += [
        Path_(f"tuned without tune_malloc {k}", "wire", "wire", cs, malloc=False),
        Path_(f"tuned with default grpc opts {k}", "wire", "wire", cs, options=[]),
        Path_(f"tuned, sync client {k}", "wire", "wire-sync", cs),
        Path_(f"tuned server, generated client stub {k}", "wire", "generated", cs),
    ]
    for chunk in (256 << 10, MIB, 2 * MIB, 4 * MIB):
        if chunk != cs:
            rows.append(Path_(f"tuned, chunk {chunk // 1024}K", "wire", "wire", chunk))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB")
    parser.add_argument("--rounds", type=int, default=5, help="timed transfers per path, interleaved")
    parser.add_argument("--quick", action="store_true", help="headline paths only, no sweeps")
    parser.add_argument("--sweep-options", action="store_true", help="compare candidate gRPC options instead")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--digest", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)  # exact payload size (bench_promote: not a whole MiB)
    args = parser.parse_args()
    size = args.bytes or args.mib * MIB
    if args.serve:
        return serve(Path_(**json.loads(args.serve)), args.payload)
    if args.client:
        return client(Path_(**json.loads(args.client)), args.port, size, args.digest)

    t0 = time.perf_counter()
    rows = option_sweep() if args.sweep_options else paths(args.quick)
    times: dict[str, list[float]] = {row.label: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="bench_transfer_") as tmp:
        payload_path = os.path.join(tmp, "payload.bin")
        payload = os.urandom(size)
        Path(payload_path).write_bytes(payload)
        digest = hashlib.sha256(payload).hexdigest()
        del payload
        load_before = os.getloadavg()[0]
        servers = {row.label: ServerProcess(row, payload_path) for row in rows}
        try:
            for round_ in range(args.rounds):
                for row in rows:
                    times[row.label].append(run_client(row, servers[row.label].port, size, digest))
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.close()
    base = size / min(times[rows[0].label])
    print(f"payload {args.mib} MiB, {args.rounds} interleaved rounds, cpus {os.cpu_count()}, "
          f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"{'path':<46}{'best MB/s':>10}{'median MB/s':>13}{'ratio':>7}{'med.ratio':>11}")
    base_median = size / statistics.median(times[rows[0].label])
    for row in rows:
        best = size / min(times[row.label])
        median = size / statistics.median(times[row.label])
        print(f"{row.label:<46}{best / 1e6:>10.0f}{median / 1e6:>13.0f}{best / base:>7.2f}{median / base_median:>11.2f}")
    print(f"ratio = best / raw socket best; med.ratio = median / raw socket median; wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
