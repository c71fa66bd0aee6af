"""Issue 13 cases 4 and 5: each Stage stream owns its upload; quota is reserved when an upload opens; real node processes."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from blake3 import blake3

from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.stage_stream import Stream, wait_offset
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("up") / "a", base_model=build_tiny_model(), r=8, lora_alpha=16, target_modules=ALL, seed=21)


def _files(adapter: Path, alpha: int) -> tuple[bytes, bytes]:
    config = json.loads((adapter / "adapter_config.json").read_bytes())
    config["lora_alpha"] = alpha
    return json.dumps(config).encode(), (adapter / "adapter_model.safetensors").read_bytes()


def test_a_second_stream_of_the_same_upload_is_refused_and_leaves_the_first_intact(tmp_path, adapter) -> None:
    node = LocalNode(tmp_path / "n", model="none", slots=2).start()  # Stage only: no model needed
    try:
        config_a, weights = _files(adapter, 16)
        config_b, _ = _files(adapter, 64)
        half = len(weights) // 2
        with grpc.insecure_channel(node.address) as channel:
            stub = fabric_pb2_grpc.FabricStub(channel)
            a = Stream(stub)
            a.begin("same", config_a, weights)
            a.data(0, weights[:half])
            wait_offset(stub, "same", weights, half)  # A's first half has landed
            b = Stream(stub)
            b.begin("same", config_b, weights)
            b.data(0, weights)
            b.end()
            assert b.error is not None and b.error.code() == grpc.StatusCode.ABORTED, b.error
            assert "another Stage stream" in b.error.details()
            a.data(half, weights[half:])
            a.end()
            assert a.error is None, a.error
        with node.client() as client:
            listed = {s.adapter_id: s for s in client.list().staged}
            assert listed["same"].digest == a.reply.digest  # A got its own content's digest ...
            assert listed["same"].peft.lora_alpha == 16  # ... and its config is what was committed
            again = client.stage(adapter, "other-id")  # the node is sound after it
            assert again.digest
    finally:
        node.stop()


def test_a_resume_waits_for_its_crashed_stream_to_let_go(tmp_path, adapter) -> None:
    """A client that crashed mid-upload and resumes at once meets its dead stream still open on the node: the new
    stream waits for it to let go (bounded) instead of being refused as Busy."""
    node = LocalNode(tmp_path / "n", model="none", slots=2).start()  # Stage only: no model needed
    try:
        config, weights = _files(adapter, 16)
        half = len(weights) // 2
        with grpc.insecure_channel(node.address) as channel:
            stub = fabric_pb2_grpc.FabricStub(channel)
            a = Stream(stub)
            a.begin("resumed", config, weights)
            a.data(0, weights[:half])
            wait_offset(stub, "resumed", weights, half)
            b = Stream(stub)
            b.begin("resumed", config, weights, offset=half)  # the node still holds A's upload open
            wait_for(lambda: "a Stage waits for an earlier stream of its upload to let go" in node.log_path.read_text(), "B to wait for A")
            a.crash()
            b.data(half, weights[half:])
            b.end()
            assert b.error is None, b.error
            assert b.reply.bytes_received == len(weights) - half
    finally:
        node.stop()


def test_a_resume_below_the_held_offset_rewinds_and_one_beyond_it_is_refused(tmp_path, adapter) -> None:
    """A client that read UploadOffset while its previous stream was still landing bytes resumes below what the node
    holds: the node drops the rest and takes the bytes again. An offset beyond what it holds is refused, state kept."""
    node = LocalNode(tmp_path / "n", model="none", slots=2).start()  # Stage only: no model needed
    try:
        config, weights = _files(adapter, 16)
        half = len(weights) // 2
        with grpc.insecure_channel(node.address) as channel:
            stub = fabric_pb2_grpc.FabricStub(channel)
            a = Stream(stub)
            a.begin("rewound", config, weights)
            a.data(0, weights[:half])
            wait_offset(stub, "rewound", weights, half)
            a.crash()
            beyond = Stream(stub)
            beyond.begin("rewound", config, weights, offset=half + 1)
            beyond.end()
            assert beyond.error is not None and beyond.error.code() == grpc.StatusCode.INVALID_ARGUMENT, beyond.error
            assert f"resumes at offset {half + 1} but this node holds {half} bytes" in beyond.error.details()
            request = fabric_pb2.UploadOffsetRequest(adapter_id="rewound", safetensors_blake3=blake3(weights).hexdigest())
            assert stub.UploadOffset(request, timeout=30).offset == half  # the refusal kept the upload as it was
            quarter = half // 2
            b = Stream(stub)
            b.begin("rewound", config, weights, offset=quarter)
            b.data(quarter, weights[quarter:])
            b.end()
            assert b.error is None, b.error
        with node.client() as client:
            assert {s.adapter_id: s.digest for s in client.list().staged}["rewound"] == b.reply.digest
    finally:
        node.stop()


def test_two_uploads_opened_together_cannot_pass_the_store_limit(tmp_path, adapter) -> None:
    config, weights = _files(adapter, 16)
    config2, _ = _files(adapter, 32)
    weights2 = bytearray(weights)
    weights2[-1] ^= 1  # other bytes, same size
    limit = int(len(weights) * 1.5)
    node = LocalNode(tmp_path / "n", model="none", slots=2, extra_args=["--max-store-bytes", str(limit)]).start()
    try:
        with grpc.insecure_channel(node.address) as channel:
            stub = fabric_pb2_grpc.FabricStub(channel)
            first, second = Stream(stub), Stream(stub)
            first.begin("one", config, weights)
            first.data(0, weights[:8])  # opened, 8 bytes of it written
            wait_offset(stub, "one", weights, 8)
            second.begin("two", config2, bytes(weights2))
            second.wait(30)
            assert second.error is not None and second.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, second.error
            first.data(8, weights[8:])
            first.end()
            assert first.error is None, first.error
        with node.client() as client:
            # Near the limit, bytes already committed need no room: the same weights under a new id (and config) stage.
            assert client.stage(adapter, "one-again").digest
            assert sorted(s.adapter_id for s in client.list().staged) == ["one", "one-again"]
    finally:
        node.stop()
