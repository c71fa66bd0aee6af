"""Issue 13 cases 6 and 7: names have a grammar, "base" is reserved, error messages are bounded, not-found is NOT_FOUND,
a slot reports its digest after unstage, a unix: peer address is refused; real node processes."""

from __future__ import annotations

import grpc
import pytest

from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    adapter = make_peft_adapter(root / "a", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj"], seed=31)
    node = LocalNode(root / "store", slots=2).start()
    with node.client() as client:
        client.stage(adapter, "a")
    yield node
    node.stop()


def _call(node, method: str, request):
    with grpc.insecure_channel(node.address, options=[("grpc.max_send_message_length", 4 << 20)]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            getattr(fabric_pb2_grpc.FabricStub(channel), method)(request, timeout=60)
    return info.value


def _slot_names(node) -> list[str]:
    with node.client() as client:
        return [s.name for s in client.list().slots if s.name]


@pytest.mark.parametrize("name", ["base", "a\0b", "a\nb", "x" * (1 << 20), "x" * 129, "white space"], ids=["base", "nul", "newline", "1MiB", "129", "space"])
def test_a_bad_or_reserved_name_is_refused_before_anything_moves(node, name) -> None:
    before = _slot_names(node)
    error = _call(node, "Promote", fabric_pb2.PromoteRequest(adapter_id="a", name=name))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    # A name past the field bound (adapter_fabric.rpc.bounds) is refused at the service edge, naming the field instead.
    assert ("adapter name" in error.details() or "PromoteRequest.name" in error.details()) and len(error.details()) < 2048
    assert _slot_names(node) == before


def test_not_found_is_not_found_whatever_the_name(node) -> None:
    """Up to the field bound (1024 characters) an unknown name is NOT_FOUND; past it, the edge refuses it by field name."""
    for name in ("nope", "y" * 1024, "y" * 20_000, "y" * (1 << 20)):
        for method, request in (
            ("Generate", fabric_pb2.GenerateRequest(adapter=name, input_ids=PROMPT)),
            ("SetActive", fabric_pb2.SetActiveRequest(name=name)),
        ):
            error = _call(node, method, request)
            expected = grpc.StatusCode.NOT_FOUND if len(name) <= 1024 else grpc.StatusCode.INVALID_ARGUMENT
            assert error.code() == expected, (method, len(name), error.code())
            assert len(error.details()) < 2048


def test_a_slot_reports_its_digest_after_unstage(node, tmp_path) -> None:
    with node.client() as client:
        reply = client.promote("a", name="held")
        client.unstage("a")
        slot = next(s for s in client.list().slots if s.name == "held")
        assert slot.digest == reply.digest
        assert len(client.generate(PROMPT, "held", max_new_tokens=2).output_ids) == 2


@pytest.mark.parametrize("peer", ["unix:/tmp/fabric.sock", "unix-abstract:x", "host/path:1", "nohost", "h:99999"])
def test_a_peer_address_that_is_not_host_port_is_refused(node, peer) -> None:
    error = _call(node, "Promote", fabric_pb2.PromoteRequest(adapter_id="zzz", peer=peer))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "host:port" in error.details(), error
