"""Issue 33 (operator 7): right after a peer restarts and answers SERVING, a node that failed to reach it pulls from it
at once; it answered "Connection refused" for seconds more (its channel waited out gRPC's reconnect backoff)."""

from __future__ import annotations

import time

import pytest

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import make_peft_adapter

pytestmark = pytest.mark.slow  # real node processes

#: how long the puller keeps failing against the stopped peer: its channel's backoff grows meanwhile (1 s, 1.6 s, 2.6 s...)
FAILING_S = 2.5


def test_a_restarted_peer_is_pulled_from_as_soon_as_it_serves(tmp_path) -> None:
    port = free_port()
    peer = LocalNode(tmp_path / "peer", model="none", port=port).start()
    puller = LocalNode(tmp_path / "puller", model="none", port=free_port(), peers=[peer.address]).start()
    try:
        with peer.client() as client:
            client.stage(make_peft_adapter(tmp_path / "a", r=4, seed=5), "r/a")
        peer.stop()
        with puller.client() as client:
            started = time.monotonic()
            while time.monotonic() - started < FAILING_S:  # not an assertion on time: it only lets the old backoff grow
                with pytest.raises(PeerUnavailable):
                    client.pull("r/a", peer=peer.address)
                time.sleep(0.1)
            peer = LocalNode(tmp_path / "peer", model="none", port=port).start()  # returns once it answers SERVING
            reply = client.pull("r/a", peer=peer.address)  # at once: no "Connection refused" from a stale channel
        assert reply.source_peers == [peer.address] and reply.bytes_transferred > 0
    finally:
        puller.stop()
        peer.stop()
