#!/usr/bin/env python
"""Transfer benchmark: how fast one Fetch stream moves bytes between two processes on loopback.

Side by side, for one payload of random bytes (default 256 MiB):

  raw socket       TCP sendall / recv_into a preallocated buffer: the physical baseline
  grpc default     generated stubs, fabric_pb2.Chunk messages, default gRPC options
  tuned            adapter_fabric.transport.wire: hand-encoded chunks, raw-bytes handler and stub, tuned
                   options, wire.tune_malloc() in both processes
  tuned + BLAKE3   the same, hashing every chunk on the receiving side as a pulling node does
                   (digest scheme 2: the one verification pass)
  tuned + sha256   the same with sha256, as digest scheme 1 did (in the event loop, or in a
                   worker thread overlapping the next receive); kept as the reference

plus what each piece buys (tuned without tune_malloc; with default gRPC options)
and sweeps: Fetch chunk size, a sync client instead of grpc.aio, the generated
stub as client. A single stream throughout: no parallel streams.

Every server is its own process (the harness in fabric/harness/bench.py), serving the payload from an mmap of one temp
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
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapter_fabric.harness.bench import MIB, ServerProcess, TransferPath, run_client
from adapter_fabric.harness.flag_bounds import refuse_out_of_range


# ------------------------------------------------------------------ driver


def option_sweep() -> list[TransferPath]:
    """--sweep-options: gRPC options that were candidates for wire.CHANNEL_OPTIONS."""
    from adapter_fabric.transport import wire

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
    rows = [TransferPath("raw socket (sendall / recv_into)", "raw-socket", "raw-socket")]
    rows += [TransferPath(f"opts: {name}", "wire", "wire", cs, options=opts) for name, opts in candidates.items()]
    return rows


def paths(quick: bool) -> list[TransferPath]:
    from adapter_fabric.transport import wire

    cs = wire.FETCH_CHUNK_SIZE
    k = f"{cs // 1024}K"
    rows = [
        TransferPath("raw socket (sendall / recv_into)", "raw-socket", "raw-socket"),
        TransferPath(f"grpc default (pb2.Chunk, default opts) {k}", "grpc-default", "generated", cs, options=[], malloc=False),
        TransferPath(f"tuned (adapter_fabric.transport.wire, aio client) {k}", "wire", "wire", cs),
        TransferPath(f"tuned + BLAKE3 per chunk {k}", "wire", "wire-blake3", cs),
        TransferPath(f"data channel (sendfile / recv_into) {k}", "data-channel", "data-channel", cs),
        TransferPath(f"data channel + BLAKE3 per chunk {k}", "data-channel", "data-channel-blake3", cs),
        TransferPath(f"tuned + sha256 per chunk {k}", "wire", "wire-sha256", cs),
        TransferPath(f"tuned + sha256 per chunk in a thread {k}", "wire", "wire-sha256-thread", cs),
    ]
    if quick:
        return rows
    rows += [
        TransferPath(f"tuned without tune_malloc {k}", "wire", "wire", cs, malloc=False),
        TransferPath(f"tuned with default grpc opts {k}", "wire", "wire", cs, options=[]),
        TransferPath(f"tuned, sync client {k}", "wire", "wire-sync", cs),
        TransferPath(f"tuned server, generated client stub {k}", "wire", "generated", cs),
    ]
    for chunk in (256 << 10, MIB, 2 * MIB, 4 * MIB):
        if chunk != cs:
            rows.append(TransferPath(f"tuned, chunk {chunk // 1024}K", "wire", "wire", chunk))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB (1 to 4096)")
    parser.add_argument("--rounds", type=int, default=5, help="timed transfers per path, interleaved (1 to 1000)")
    parser.add_argument("--quick", action="store_true", help="headline paths only, no sweeps")
    parser.add_argument("--sweep-options", action="store_true", help="compare candidate gRPC options instead")
    args = parser.parse_args()
    refuse_out_of_range(parser, (
        ("--mib", args.mib, 1, 4096, "the payload is held in memory here and in each client"),
        ("--rounds", args.rounds, 1, 1000, "timed transfers per path, a median"),
    ))
    size = args.mib * MIB

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
