"""Issue 13 case 7: a pull that gives up names its cause; real node processes.

A seed that unstages the adapter mid-pull (NOT_FOUND on the next Fetch), and
a seed that refuses every stream as busy (RESOURCE_EXHAUSTED from
--max-streams-per-peer): the puller's final error says so, and its type says
what the caller can do (AdapterNotFound when no peer holds the adapter any
more, PeerUnavailable, retryable, otherwise).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from fabric.errors import AdapterNotFound, FabricError, PeerUnavailable
from fabric.harness.cluster import LocalNode, free_port
from fabric.serving.tiny import build_tiny_model, make_peft_adapter
from fabric.v1 import fabric_pb2, fabric_pb2_grpc

pytestmark = pytest.mark.timeout(240)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: 134 616 bytes in 33 chunks of 4 KiB: at 8 KiB/s a pull lasts about 16 s, so the test's unstage lands mid-pull even under load
RATE = 8 << 10
STALL = ["--stall-timeout", "2"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("causes")
    return make_peft_adapter(root / "a", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=ALL, seed=41)


def seed_node(root: Path, *extra: str) -> LocalNode:
    return LocalNode(root / "seed", model="none", port=free_port(), extra_args=["--chunk-size", "4096", "--upload-rate", str(RATE), *extra])


def pull_in_thread(client, adapter_id: str, peer: str, named_peer_only: bool) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = client.pull(adapter_id, peer=peer, named_peer_only=named_peer_only)
        except FabricError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def verified(client, digest: str) -> int:
    """Chunks of ``digest`` the node holds verified (0 before its pull opened a partial)."""
    try:
        return client.availability(digest).verified_chunks
    except AdapterNotFound:
        return 0


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("with_dead_peer", [False, True], ids=["only-seed", "and-a-dead-peer"])
def test_a_seed_that_unstages_mid_pull_is_named_as_no_longer_holding_it(tmp_path, adapter, with_dead_peer) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    seed = seed_node(tmp_path).start()
    node = LocalNode(tmp_path / "node", model="none", port=free_port(), peers=[dead] if with_dead_peer else [], extra_args=STALL).start()
    try:
        with seed.client() as s, node.client() as c:
            digest = s.stage(adapter, "a").digest
            thread, outcome = pull_in_thread(c, "a", seed.address, named_peer_only=not with_dead_peer)
            wait_for(lambda: verified(c, digest) >= 2, "the pull to verify its first chunks")
            s.unstage("a")
            thread.join(120)
        error = outcome.get("error")
        assert error is not None, f"the pull succeeded: {outcome}"
        message = str(error)
        assert f"{seed.address}: no longer holds 'a' (NOT_FOUND): it was unstaged or lost there" in message, message
        assert "kept for resume" in message
        if with_dead_peer:
            # The dead peer failed otherwise: not every peer said not found, so it stays retryable.
            assert type(error) is PeerUnavailable, repr(error)
            assert dead in message, message
        else:
            assert type(error) is AdapterNotFound, repr(error)
        with node.client() as c:
            assert [a.adapter_id for a in c.list().staged] == []
    finally:
        node.stop()
        seed.stop()


def test_a_pull_refused_as_busy_names_the_busy_peer_when_it_gives_up(tmp_path, adapter) -> None:
    seed = seed_node(tmp_path, "--max-streams-per-peer", "1").start()
    node = LocalNode(tmp_path / "node", model="none", port=free_port(), extra_args=STALL).start()
    try:
        with seed.client() as s:
            manifest = s.manifest(s.stage(adapter, "a").adapter_id)
        # This test holds the seed's one Fetch stream for loopback (the node dials from the same host).
        channel = grpc.insecure_channel(seed.address)
        held = fabric_pb2_grpc.FabricStub(channel).Fetch(
            fabric_pb2.FetchRequest(digest=manifest.digest, file=manifest.weights.name, offset=0, length=manifest.weights.size)
        )
        try:
            next(held)  # the stream is open and counted
            with node.client() as c:
                with pytest.raises(PeerUnavailable) as caught:
                    c.pull("a", peer=seed.address, named_peer_only=True)
            message = str(caught.value)
            assert f"{seed.address}: refused the stream as busy (RESOURCE_EXHAUSTED)" in message, message
            assert "--max-streams-per-peer" in message, message
        finally:
            held.cancel()
            channel.close()
        with node.client() as c:  # the cause was the busy stream: without it the same pull completes
            assert c.pull("a", peer=seed.address, named_peer_only=True).digest == manifest.digest
    finally:
        node.stop()
        seed.stop()
