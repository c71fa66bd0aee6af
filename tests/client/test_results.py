"""The client's result dataclasses (``adapter_fabric.client.results``): built from the wire's replies, JSON-ready as the CLI prints them."""

from __future__ import annotations

import json

from adapter_fabric.client.results import PromoteResult, hex_id, json_ready
from adapter_fabric.v1 import fabric_pb2


def test_a_content_id_is_shown_as_0x_and_16_hex_digits() -> None:
    assert hex_id(1) == "0x0000000000000001" and hex_id((1 << 64) - 1) == "0xffffffffffffffff"


def test_json_ready_renders_u64_ids_and_bytes_at_any_depth_and_leaves_the_rest() -> None:
    value = {"content_id": 255, "slots": [{"content_id": 1, "rank": 8}], "bitmap": b"\x01\xff", "name": "a"}
    ready = json_ready(value)
    assert ready == {"content_id": "0x00000000000000ff", "slots": [{"content_id": "0x0000000000000001", "rank": 8}], "bitmap": "01ff", "name": "a"}
    json.dumps(ready)  # plain JSON: no int past 2**53 a JavaScript reader would round


def test_a_promote_reply_becomes_a_result_naming_every_source_peer() -> None:
    reply = fabric_pb2.PromoteResponse(
        slot=2, evicted_name="old", content_id=7, digest="d" * 64, bytes_transferred=10, source_peer="a:1,b:2", pull_seconds=0.5
    )
    result = PromoteResult.from_proto(reply)
    assert (result.slot, result.evicted_name, result.source_peers, result.source_peer) == (2, "old", ["a:1", "b:2"], "a:1,b:2")
    assert result.to_dict()["content_id"] == hex_id(7) and not result.joined
    assert PromoteResult.from_proto(fabric_pb2.PromoteResponse(slot=-1)).source_peers == []  # nothing moved: no source
