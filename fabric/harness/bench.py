"""What the benchmarks share (scripts/bench_*.py, and the tests that run a small version of one).

- ``make_adapter``: a PEFT-named LoRA adapter of a given size, made in code
  (scripts/bench_swarm.py, tests/transport/test_multihost.py);
- ``make_small_adapters``: many distinct small PEFT adapters, fast (scripts/bench_stage.py,
  tests/node/test_bulk_stage.py);
- the one-stream transfer harness (scripts/bench_transfer.py, scripts/bench_promote.py):
  a ``TransferPath`` is one row of a table, a server process (``ServerProcess``,
  serving a payload file from an mmap) and a timed client process per transfer
  (``run_client``, a fresh connection each time). Both processes are this
  module run as ``python -m adapter_fabric.harness.bench --serve ... | --client ...``.
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
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blake3 import blake3

MIB = 1 << 20


def make_small_adapters(root: Path, count: int) -> list[Path]:
    """``count`` distinct small PEFT adapters (a tiny model's, ~20 KB) under ``root``: one made with PEFT, copied,
    8 bytes of its tensor data set to the copy's number, so each has its own digest and weights blob."""
    import shutil

    from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

    template = make_peft_adapter(root / "template", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1)
    weights = (template / "adapter_model.safetensors").read_bytes()
    start = 8 + int.from_bytes(weights[:8], "little")  # tensor data starts after the header
    dirs = []
    for index in range(count):
        directory = root / f"a{index:05d}"
        directory.mkdir()
        shutil.copyfile(template / "adapter_config.json", directory / "adapter_config.json")
        data = bytearray(weights)
        data[start : start + 8] = index.to_bytes(8, "little")
        (directory / "adapter_model.safetensors").write_bytes(bytes(data))
        dirs.append(directory)
    return dirs


def make_adapter(out: Path, size_mib: int, hidden: int = 4096, rank: int = 32) -> Path:
    """A PEFT-named LoRA adapter of ``size_mib`` MiB (F32, q_proj and v_proj per layer, 1 MiB per module at the defaults)."""
    import torch
    from safetensors.torch import save_file

    per_module = 2 * rank * hidden * 4
    layers = max(1, (size_mib << 20) // (2 * per_module))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "base_model_name_or_path": "bench-swarm"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# ------------------------------------------------------------------ the transfer harness


@dataclasses.dataclass
class TransferPath:
    """One row of the table: a server process and how each client transfer runs."""

    label: str
    server: str  # "raw-socket" | "grpc-default" | "wire" | "data-channel"
    # "raw-socket" | "generated" | "wire" | "wire-blake3" | "wire-sha256" | "wire-sha256-thread" | "wire-sync" | "data-channel" | "data-channel-blake3"
    client: str
    chunk: int = MIB
    options: list | None = None  # both sides; None = adapter_fabric.transport.wire's tuned options
    malloc: bool = True  # wire.tune_malloc() in server and client

    def resolved_options(self) -> list:
        if self.options is not None:
            return self.options
        from adapter_fabric.transport import wire

        return [list(o) for o in wire.CHANNEL_OPTIONS]


# ------------------------------------------------------------------ servers


def serve(path: TransferPath, payload_path: str) -> None:
    """Server process: print the port, serve until stdin closes."""
    if path.malloc and path.server != "raw-socket":
        from adapter_fabric.transport import wire

        wire.tune_malloc()
    with open(payload_path, "rb") as f:
        payload = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if path.server == "raw-socket":
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_serve_raw_socket, args=(listener, payload), daemon=True).start()
        print(listener.getsockname()[1], flush=True)
        sys.stdin.read()
    elif path.server == "data-channel":
        asyncio.run(_serve_data_channel(path, payload_path))
    else:
        asyncio.run(_serve_grpc(path, payload))


def _serve_raw_socket(listener: socket.socket, payload: mmap.mmap) -> None:
    view = memoryview(payload)
    while True:
        conn, _ = listener.accept()
        with conn:
            if conn.recv(1):  # the client's "go" byte
                conn.sendall(view)


async def _serve_grpc(path: TransferPath, payload: mmap.mmap) -> None:
    import grpc

    from adapter_fabric.transport import wire
    from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

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


async def _serve_data_channel(path: TransferPath, payload_path: str) -> None:
    """The node's data channel framing (adapter_fabric.transport.data_frames), chunks written with loop.sendfile as node.data_server does."""
    from adapter_fabric.transport import data_frames

    size = os.path.getsize(payload_path)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = data_frames.hello_length(await reader.readexactly(data_frames.HELLO_PREFIX.size))
        request = data_frames.decode_hello(await reader.readexactly(length)).fetch
        end = size if request.length == 0 else min(size, request.offset + request.length)
        loop = asyncio.get_running_loop()
        with open(payload_path, "rb") as f:
            for offset in range(request.offset, end, path.chunk):
                n = min(path.chunk, end - offset)
                writer.write(data_frames.frame_header(data_frames.CHUNK, offset, n))
                await loop.sendfile(writer.transport, f, offset, n)
        writer.write(data_frames.frame_header(data_frames.END, 0, 1) + data_frames.encode_end(True, None))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()


class ServerProcess:
    def __init__(self, path: TransferPath, payload_path: str) -> None:
        argv = [sys.executable, "-m", __name__, "--serve", json.dumps(dataclasses.asdict(path)), "--payload", payload_path]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None  # both PIPE
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"server for {path.label!r} exited before listening (rc={self.proc.wait()})")
        self.port = int(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ clients


def client(path: TransferPath, port: int, size: int, digest: str) -> None:
    """Client process: one timed transfer on a fresh connection; print seconds."""
    if path.malloc and path.client != "raw-socket":
        from adapter_fabric.transport import wire

        wire.tune_malloc()
    out = bytearray(b"\x01") * size  # pre-touched: page faults on the target are not what we measure
    if path.client == "raw-socket":
        seconds = _client_raw_socket(port, size, out)
    elif path.client == "wire-sync":
        seconds = _client_sync(path, port, size, out)
    elif path.client.startswith("data-channel"):
        seconds = _client_data_channel(path, port, size, out)
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


async def _client_aio(path: TransferPath, port: int, size: int, out: bytearray) -> float:
    import grpc

    from adapter_fabric.transport import wire
    from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

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


def _client_sync(path: TransferPath, port: int, size: int, out: bytearray) -> float:
    import grpc

    from adapter_fabric.transport import wire
    from adapter_fabric.v1 import fabric_pb2

    view = memoryview(out)
    options = [tuple(o) for o in path.resolved_options()]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        start = time.perf_counter()
        got = _copy_into(view, wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest="bench")))
        seconds = time.perf_counter() - start
    _check_size(path, got, size)
    return seconds


def _copy_into(view: memoryview, chunks: Any, each: Callable[[memoryview], Any] | None = None) -> int:
    """Copy every ``(offset, data)`` of a stream into ``view`` (``each`` sees each chunk first); returns the bytes moved."""
    got = 0
    for offset, data in chunks:
        if each is not None:
            each(data)
        view[offset : offset + len(data)] = data
        got += len(data)
    return got


def _check_size(path: TransferPath, got: int, size: int) -> None:
    if got != size:
        raise SystemExit(f"{path.label}: got {got} of {size} bytes")


def _client_data_channel(path: TransferPath, port: int, size: int, out: bytearray) -> float:
    """The puller's data channel client (adapter_fabric.transport.data_channel): recv_into one buffer, then the copy into ``out``."""
    from adapter_fabric.transport import fetch_metadata
    from adapter_fabric.transport.data_channel import DataChannels
    from adapter_fabric.v1 import fabric_pb2

    channels, peer = DataChannels(), "127.0.0.1:1"
    channels.learn(peer, fetch_metadata.announce_data_port(port))
    view, verify = memoryview(out), path.client.endswith("blake3")
    start = time.perf_counter()
    call = channels.open(peer, fabric_pb2.FetchRequest(digest="bench"), None, path.chunk)
    if call is None:
        raise SystemExit(f"{path.label}: the data channel on port {port} could not be reached")
    got = _copy_into(view, call, (lambda data: blake3(data).digest()) if verify else None)
    seconds = time.perf_counter() - start
    _check_size(path, got, size)
    return seconds


def run_client(path: TransferPath, port: int, size: int, digest: str) -> float:
    argv = [sys.executable, "-m", __name__, "--client", json.dumps(dataclasses.asdict(path))]
    argv += ["--port", str(port), "--bytes", str(size), "--digest", digest]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"client for {path.label!r} failed (rc={done.returncode})")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """The server and client processes of the transfer harness (started by ``ServerProcess`` and ``run_client``)."""
    parser = argparse.ArgumentParser(description="one process of the transfer harness (adapter_fabric.harness.bench)")
    parser.add_argument("--serve", help="a TransferPath as JSON: serve its payload, print the port, stop when stdin closes")
    parser.add_argument("--client", help="a TransferPath as JSON: one timed transfer, print its seconds")
    parser.add_argument("--payload", help="the payload file (--serve)")
    parser.add_argument("--port", type=int, help="the server's port (--client)")
    parser.add_argument("--digest", help="the payload's sha256 (--client)")
    parser.add_argument("--bytes", type=int, help="the payload's size (--client)")
    args = parser.parse_args()
    if args.serve:
        return serve(TransferPath(**json.loads(args.serve)), args.payload)
    if args.client:
        return client(TransferPath(**json.loads(args.client)), args.port, args.bytes, args.digest)
    parser.error("one of --serve or --client")


if __name__ == "__main__":
    main()
