"""Issue 28 (8): a revocation takes effect for Fetch streams already running, at their next chunk, with a real policy node.

A principal's stream is held open at a known point, not by a rate limit: the
test reads a little of a 4 MiB adapter through a small receive window (gRPC:
HTTP/2 lookahead; the data channel: SO_RCVBUF) and no more, so the node cannot
send the rest. The policy then loses the principal's ``pull`` (an edit and a
SIGHUP, in force once ``whoami`` says so); the stream, read on, ends refused
before its end instead of carrying the adapter whole.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import PermissionDenied, Unauthenticated
from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc.status import error_from_detail
from adapter_fabric.transport import data_frames, wire
from adapter_fabric.v1 import fabric_pb2

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-51d7", "engine": "engine-token-08ae"}
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 16 << 10), ("grpc.http2.bdp_probe", 0)]
WAIT_S = 30.0


def policy_text(verbs: list[str]) -> str:
    listed = ", ".join(f'"{v}"' for v in verbs)
    return f"""
[[principal]]
name = "engine"
token_sha256 = "{token_sha256(TOKENS['engine'])}"
grants = [{{ verbs = [{listed}], prefixes = ["team-a/"] }}]
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("revocation")
    adapter = make_adapter(root / "big", size_mib=4, hidden=1024, rank=16)
    (root / "cluster.token").write_text(TOKENS["cluster"])
    policy = root / "policy.toml"
    policy.write_text(policy_text(["read", "pull"]))
    node = LocalNode(
        root / "store", model="none", token_file=root / "cluster.token",
        extra_args=["--policy", str(policy), "--chunk-size", "4096", "--stall-timeout", "120"],
    ).start()
    try:
        with node.client() as admin:
            manifest = admin.manifest(admin.stage(adapter, "team-a/big").adapter_id)
        yield {"node": node, "policy": policy, "manifest": manifest, "size": (adapter / "adapter_model.safetensors").stat().st_size}
    finally:
        node.stop()


def set_verbs(world: dict, verbs: list[str]) -> None:
    """Put ``verbs`` in force for the engine principal: edit, SIGHUP, and wait until its whoami says so."""
    world["policy"].write_text(policy_text(verbs))
    os.kill(world["node"].pid, signal.SIGHUP)
    deadline = time.monotonic() + WAIT_S
    with NodeClient(world["node"].address, token=TOKENS["engine"]) as engine:
        while sorted(v for g in engine.whoami().grants for v in g.verbs) != sorted(verbs):
            assert time.monotonic() < deadline, f"the policy with {verbs} never came in force"
            time.sleep(0.05)


def test_a_revoked_principals_grpc_fetch_ends_at_its_next_chunk(world) -> None:
    set_verbs(world, ["read", "pull"])
    manifest = world["manifest"]
    request = fabric_pb2.FetchRequest(digest=manifest.digest, file=manifest.weights.name, offset=0, length=manifest.weights.size)
    with grpc.insecure_channel(world["node"].address, options=SMALL_WINDOW) as channel:
        held = wire.fetch_stub(channel)(request, metadata=(("authorization", f"Bearer {TOKENS['engine']}"),))
        received = sum(len(next(held)[1]) for _ in range(2))
        set_verbs(world, ["read"])
        with pytest.raises(grpc.RpcError) as cut:
            for _, data in held:
                received += len(data)
    assert cut.value.code() == grpc.StatusCode.PERMISSION_DENIED and "lacks 'pull'" in cut.value.details()
    assert received < world["size"]


def test_a_revoked_principals_data_channel_stream_ends_at_its_next_chunk(world) -> None:
    set_verbs(world, ["read", "pull"])
    port = int(re.search(r"data channel on port (\d+)", world["node"].banner).group(1))
    request = fabric_pb2.FetchRequest(digest=world["manifest"].digest)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        held.connect(("127.0.0.1", port))
        held.sendall(data_frames.encode_hello(fabric_pb2.DataHello(token=TOKENS["engine"], fetch=request)))
        data = bytearray(held.recv(data_frames.FRAME.size))  # the stream started: its first chunk is on its way
        set_verbs(world, ["read"])
        held.settimeout(WAIT_S)
        while more := held.recv(1 << 16):
            data += more
    frames, pos, chunks = [], 0, 0
    while pos + data_frames.FRAME.size <= len(data):
        kind, _, length = data_frames.parse_frame_header(bytes(data[pos:pos + data_frames.FRAME.size]))
        frames.append((kind, bytes(data[pos + data_frames.FRAME.size:pos + data_frames.FRAME.size + length])))
        pos += data_frames.FRAME.size + length
        chunks += length if kind == data_frames.CHUNK else 0
    assert frames[-1][0] == data_frames.ERROR and chunks < world["size"], [k for k, _ in frames][-3:]
    error = error_from_detail(frames[-1][1])
    assert isinstance(error, PermissionDenied) and "lacks 'pull'" in str(error)


def test_a_stream_the_policy_still_allows_runs_to_its_end_across_a_reload(world) -> None:
    set_verbs(world, ["read", "pull"])
    manifest = world["manifest"]
    request = fabric_pb2.FetchRequest(digest=manifest.digest, file=manifest.weights.name, offset=0, length=manifest.weights.size)
    other = "other-token-3b90"
    with grpc.insecure_channel(world["node"].address, options=SMALL_WINDOW) as channel:
        held = wire.fetch_stub(channel)(request, metadata=(("authorization", f"Bearer {TOKENS['engine']}"),))
        received = sum(len(next(held)[1]) for _ in range(2))
        # a reload that leaves the engine's grants as they were (it adds a principal): in force once that one is known
        world["policy"].write_text(policy_text(["read", "pull"]) + f"""
[[principal]]
name = "other"
token_sha256 = "{token_sha256(other)}"
grants = [{{ verbs = ["read"], prefixes = ["team-b/"] }}]
""")
        os.kill(world["node"].pid, signal.SIGHUP)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with NodeClient(world["node"].address, token=other) as c:
                    assert c.whoami().principal == "other"
                break
            except Unauthenticated:
                assert time.monotonic() < deadline, "the reload never came in force"
                time.sleep(0.05)
        received += sum(len(data) for _, data in held)
    assert received == world["size"]
