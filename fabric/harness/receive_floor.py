"""The least a verified, durable, staged receive costs on this machine: the floor beside a promote (scripts/bench_promote.py).

A promote's receiver must touch each byte at least four times: the socket's copy into memory, a hash that verifies
it, the write that makes it durable (the page cache's copy, then the disk), and the copy into the slot row being
staged. ``receive_floor`` does exactly those, with nothing else: one thread, 1 MiB chunks read whole from a raw
socket (``adapter_fabric.harness.bench``'s raw-socket server), BLAKE3 per chunk, ``os.pwrite`` into a fresh file,
a contiguous copy into a pre-touched row, the disk's writeback started every 8 MiB (as a partial does) and one
``fsync`` at the end. No protocol, manifest, store or thread
hand-off: what it costs is what the four passes cost here, the physical limit for a receiver that keeps every
guarantee a promote keeps.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from blake3 import blake3

from adapter_fabric.store.files import WRITEBACK_RUN, start_writeback

CHUNK = 1 << 20  # the data channel's chunk


def receive_floor(port: int, size: int, row: memoryview, directory: Path) -> tuple[float, float]:
    """Receive ``size`` bytes from the raw-socket server on ``port``: (seconds, CPU seconds of this process)."""
    if len(row) < size:
        raise ValueError(f"the row holds {len(row)} bytes, the payload is {size}")
    buffer = memoryview(bytearray(CHUNK))
    path = directory / "receive-floor.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            cpu, start = time.process_time(), time.perf_counter()
            sock.sendall(b"g")  # the server's "go"
            got = 0
            while got < size:
                want = min(CHUNK, size - got)
                filled = 0
                while filled < want:
                    n = sock.recv_into(buffer[filled:want], want - filled)
                    if n == 0:
                        raise ConnectionError(f"the raw socket closed after {got + filled} of {size} bytes")
                    filled += n
                chunk = buffer[:want]
                blake3(chunk).digest()
                os.pwrite(fd, chunk, got)
                row[got : got + want] = chunk
                got += want
                if got % WRITEBACK_RUN == 0:
                    start_writeback(fd, got - WRITEBACK_RUN, WRITEBACK_RUN)
            os.fsync(fd)
            return time.perf_counter() - start, time.process_time() - cpu
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
