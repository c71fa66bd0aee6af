"""Peer reads (node/peer_reads.py) against a real node process: what an unstage does to a Fetch already streaming.

The stream is held open at a known point, not by a rate limit: the test reads
two messages through a small HTTP/2 receive window and no more, so the node
cannot send the rest (the adapter is eight times the window) and its Fetch
handler stays inside the file it opened. That it is still open is checked,
not assumed: with --max-streams-per-peer 1 a second stream is refused as busy.
"""

from __future__ import annotations

import grpc
import pytest
from blake3 import blake3

from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.manifest import WEIGHTS_FILE
from adapter_fabric.transport import fetch_metadata, wire
from adapter_fabric.v1 import fabric_pb2

pytestmark = pytest.mark.slow  # real node processes (the quick tier leaves them out: -m 'not slow')

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 16 << 10), ("grpc.http2.bdp_probe", 0)]


def test_an_unstage_lets_a_fetch_already_streaming_finish_from_the_file_it_opened(tmp_path) -> None:
    adapter = make_peft_adapter(tmp_path / "a", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=ALL, seed=41)
    weights = (adapter / WEIGHTS_FILE).read_bytes()
    assert len(weights) > 8 * (16 << 10)
    seed = LocalNode(tmp_path / "seed", model="none", port=free_port(), extra_args=["--chunk-size", "4096", "--max-streams-per-peer", "1"]).start()
    try:
        with seed.client() as client:
            manifest = client.manifest(client.stage(adapter, "a").adapter_id)

        def fetch(channel: grpc.Channel):
            request = fabric_pb2.FetchRequest(digest=manifest.digest, file=manifest.weights.name, offset=0, length=manifest.weights.size)
            return wire.fetch_stub(channel)(request)

        with grpc.insecure_channel(seed.address, options=SMALL_WINDOW) as held_channel, grpc.insecure_channel(seed.address) as other:
            held = fetch(held_channel)
            received = bytearray()
            for _ in range(2):
                offset, data = next(held)
                assert offset == len(received)
                received += data
            with pytest.raises(grpc.RpcError) as busy:
                list(fetch(other))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the held stream is still open on the node

            with seed.client() as client:
                client.unstage("a")
                assert [a.adapter_id for a in client.list().staged] == []

            for offset, data in held:  # the stream goes on, from the file it opened, to its end
                assert offset == len(received)
                received += data
            assert blake3(bytes(received)).digest() == blake3(weights).digest()
            assert fetch_metadata.complete()[0] in tuple(held.trailing_metadata())  # it ended well

            with pytest.raises(grpc.RpcError) as gone:
                list(fetch(other))  # a Fetch opened after the unstage is refused
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        seed.stop()
