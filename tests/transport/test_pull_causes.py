"""A pull that gives up names its cause; real node processes.

A seed that unstages the adapter mid-pull (NOT_FOUND on the next Fetch), and
a seed that refuses every stream as busy (RESOURCE_EXHAUSTED from
--max-streams-per-peer): the puller's final error says so, and its type says
what the caller can do (AdapterNotFound when no peer holds the adapter any
more, PeerUnavailable, retryable, otherwise).

Each test decides the order of events itself, never with a rate limit against
a timer: the unstage lands while the pull is held at a known chunk (a relay,
tests/support/peers/gated_peer.py, holds it there), and the stream that makes
the seed busy is held open by HTTP/2 flow control (the test reads one message
through a small receive window and no more).
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from adapter_fabric.errors import AdapterNotFound, FabricError, PeerUnavailable
from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.observability.metrics import DATA_FALLBACKS, FETCH_STREAMS
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.pull import PeerPuller
from adapter_fabric.transport import wire
from adapter_fabric.v1 import fabric_pb2
from tests.support.relays import GatedRelay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the stall watchdog also ends a pull once no peer can serve the rest; the relay's hold lasts one unstage RPC
STALL = ["--stall-timeout", "3"]
#: a receive window far below the adapter (134 616 bytes): the seed can send a few chunks, then waits for the reader
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 16 << 10), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("causes")
    return make_peft_adapter(root / "a", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=ALL, seed=41)


def seed_node(root: Path, *extra: str) -> LocalNode:
    return LocalNode(root / "seed", model="none", port=free_port(), extra_args=["--chunk-size", "4096", *extra])


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


@pytest.mark.parametrize("with_dead_peer", [False, True], ids=["only-seed", "and-a-dead-peer"])
def test_a_seed_that_unstages_mid_pull_is_named_as_no_longer_holding_it(tmp_path, adapter, with_dead_peer) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    seed = seed_node(tmp_path).start()
    relay = GatedRelay(seed.address, hold_after=2)
    node = LocalNode(tmp_path / "node", model="none", port=free_port(), peers=[dead] if with_dead_peer else [], extra_args=STALL).start()
    try:
        with seed.client() as s, node.client() as c:
            s.stage(adapter, "a")
            thread, outcome = pull_in_thread(c, "a", relay.address, named_peer_only=not with_dead_peer)
            relay.wait_holding()  # two chunks sent, the third not asked for yet
            s.unstage("a")
            relay.go()
            thread.join(120)
        error = outcome.get("error")
        assert error is not None, f"the pull succeeded: {outcome}"
        message = str(error)
        assert f"{relay.address}: no longer holds 'a' (NOT_FOUND): it was unstaged or lost there" in message, message
        assert "kept for resume" in message, message
        if with_dead_peer:
            # The dead peer failed otherwise: not every peer said not found, so it stays retryable.
            assert type(error) is PeerUnavailable, repr(error)
            assert dead in message, message
        else:
            assert type(error) is AdapterNotFound, repr(error)
        with node.client() as c:
            assert [a.adapter_id for a in c.list().staged] == []
    finally:
        relay.kill()
        node.stop()
        seed.stop()


def test_a_pull_refused_as_busy_names_the_busy_peer_when_it_gives_up(tmp_path, adapter) -> None:
    seed = seed_node(tmp_path, "--max-streams-per-peer", "1").start()
    node = LocalNode(tmp_path / "node", model="none", port=free_port(), extra_args=STALL).start()
    try:
        with seed.client() as s:
            manifest = s.manifest(s.stage(adapter, "a").adapter_id)
        # This test holds the seed's one Fetch stream for loopback (the node dials from the same host): it reads
        # one message and no more, and the small window keeps the seed from sending the rest, so the stream stays open.
        channel = grpc.insecure_channel(seed.address, options=SMALL_WINDOW)
        held = wire.fetch_stub(channel)(
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
            # the refusal named that limit, which gRPC Fetch is under too: the node never sent the pull over gRPC for it
            assert "fetching from it over gRPC" not in node.log_path.read_text()
        finally:
            held.cancel()
            channel.close()
        with node.client() as c:  # the cause was the busy stream: without it the same pull completes
            assert c.pull("a", peer=seed.address, named_peer_only=True).digest == manifest.digest
    finally:
        node.stop()
        seed.stop()


def test_a_seed_that_takes_one_stream_per_peer_serves_a_pull_of_two_streams_with_neither_a_back_off_nor_grpc(tmp_path) -> None:
    """A pull from one source opens two streams (``swarm.window_for``); a seed with ``--max-streams-per-peer 1`` refuses
    whichever comes second while the first is open (20 MiB: two runs of 10 chunks). That refusal is the seed's limit,
    not its load: the pull goes on with the stream it took (no back-off, no fallback to gRPC, which the same limit
    refuses), and later pulls from it ask one stream at a time (``PeerChannels.takes_streams_beside``)."""
    seed = LocalNode(tmp_path / "seed", model="none", port=free_port(), extra_args=["--max-streams-per-peer", "1"]).start()
    try:
        with seed.client() as s:
            manifest = s.manifest(s.stage(make_adapter(tmp_path / "big", size_mib=20, hidden=1024, rank=64), "big").adapter_id)
        channels = PeerChannels(data=DataChannels())
        fallbacks = sum(DATA_FALLBACKS.labels(reason)._value.get() for reason in ("busy", "broken"))
        over_grpc = FETCH_STREAMS.labels("grpc")._value.get()
        try:
            for round_ in range(3):
                stats = PeerPuller(AdapterStore(tmp_path / f"store-{round_}"), channels=channels).pull([seed.address], "big")[1]
                assert stats.bytes_transferred == manifest.weights.size
        finally:
            channels.close()
        assert not channels.takes_streams_beside(seed.address)  # a second stream was refused, and that was learned
        assert sum(DATA_FALLBACKS.labels(reason)._value.get() for reason in ("busy", "broken")) == fallbacks
        assert FETCH_STREAMS.labels("grpc")._value.get() == over_grpc  # every stream over the data channel
    finally:
        seed.stop()
