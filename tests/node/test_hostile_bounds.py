"""Issue 18, item 4: every string, bytes and repeated field of every request has a bound (``adapter_fabric.rpc.bounds``).

Against real node processes: a store-only node with one peer (so a Locate it
answered would be forwarded), raw generated stubs, and the node's log file
measured in bytes before and after. Oversized fields are refused with
INVALID_ARGUMENT naming the field and its limit, never echoing the value; the
property test drives every string field of every RPC (walked from the proto
descriptors) with oversized and control-character strings.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter_fabric.errors import FieldTooLarge
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc.bounds import BOUNDS, DEFAULT_LENGTH, build_table, request_types
from adapter_fabric.rpc.status import error_from_detail
from adapter_fabric.transport import data_frames
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20
#: what one refused request may add to the node's log (one line naming the field, not its value)
LOG_BYTES_PER_REQUEST = 4096
CONTROL = "\n\r\x1b\x00\x08\t\x7f"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[tuple[LocalNode, LocalNode]]:
    root = tmp_path_factory.mktemp("bounds")
    peer = LocalNode(root / "peer", model="none").start()
    node = LocalNode(root / "node", model="none", peers=[peer.address])
    try:
        node.start()
        yield node, peer
    finally:
        node.stop()
        peer.stop()


@pytest.fixture(scope="module")
def stub(nodes) -> Iterator[fabric_pb2_grpc.FabricStub]:
    options = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    with grpc.insecure_channel(nodes[0].address, options=options) as channel:
        yield fabric_pb2_grpc.FabricStub(channel)


def log_bytes(node: LocalNode) -> int:
    return Path(node.log_path).stat().st_size


def rss_bytes(node: LocalNode) -> int:
    for line in Path(f"/proc/{node.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def answering(stub) -> None:
    stub.ListAdapters(fabric_pb2.ListAdaptersRequest(), timeout=30)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def check_named(error: grpc.RpcError, field: str, limit: int) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details()[:200])
    assert field in error.details() and str(limit) in error.details(), error.details()[:300]
    assert len(error.details()) < 1024  # the value is never echoed


# ---------------------------------------------------------------- the table


def test_every_request_field_has_a_bound():
    """The table walks the descriptors: every string, bytes and repeated field reachable from a request is in it, bounded."""
    for message in request_types():
        for field in message.fields:
            bound = BOUNDS[field.full_name]
            if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                assert bound.length is not None, field.full_name
            if field.is_repeated:
                assert bound.items is not None, field.full_name
    assert build_table() == BOUNDS
    assert "fabric.v1.PeftFields.RankPatternEntry.key" in BOUNDS  # map keys too


# ---------------------------------------------------------------- the cases


def test_huge_locate_digest_refused_by_name(nodes, stub):
    node, peer = nodes
    before, peer_before = log_bytes(node), log_bytes(peer)
    error = refusal(lambda: stub.Locate(fabric_pb2.LocateRequest(digest="a" * (8 * MiB)), timeout=60))
    check_named(error, "LocateRequest.digest", BOUNDS["fabric.v1.LocateRequest.digest"].length)
    answering(stub)
    assert log_bytes(node) - before < LOG_BYTES_PER_REQUEST
    assert log_bytes(peer) - peer_before < LOG_BYTES_PER_REQUEST  # never forwarded to the peer's Availability


def test_huge_get_manifest_id_refused_by_name(nodes, stub):
    node, _ = nodes
    before = log_bytes(node)
    error = refusal(lambda: stub.GetManifest(fabric_pb2.GetManifestRequest(adapter_id="x" * (4 * MiB)), timeout=60))
    check_named(error, "GetManifestRequest.adapter_id", DEFAULT_LENGTH)
    answering(stub)
    assert log_bytes(node) - before < LOG_BYTES_PER_REQUEST


def test_twenty_huge_promote_peers_refused_and_not_kept(nodes, stub):
    node, _ = nodes
    before, rss_before = log_bytes(node), rss_bytes(node)
    for i in range(20):
        request = fabric_pb2.PromoteRequest(peer=chr(ord("a") + i) * MiB, adapter_id="some/adapter", stage_only=True)
        check_named(refusal(lambda: stub.Promote(request, timeout=60)), "PromoteRequest.peer", 512)
    answering(stub)
    assert log_bytes(node) - before < 20 * LOG_BYTES_PER_REQUEST
    grew = rss_bytes(node) - rss_before
    print(f"node RSS grew {grew / MiB:.1f} MiB over twenty 1 MiB Promote.peer strings")
    assert grew < 150 * MiB  # before the bound: 573 MB that did not come back


def test_unknown_fields_are_not_kept(nodes, stub):
    """A field this version does not know (here 8 MiB under field 99) is dropped at the edge, whatever its size."""
    node, _ = nodes
    before = log_bytes(node)
    raw = fabric_pb2.LocateRequest(digest="0" * 64).SerializeToString() + b"\x9a\x06" + _varint(8 * MiB) + b"z" * (8 * MiB)
    with grpc.insecure_channel(node.address, options=[("grpc.max_send_message_length", 64 * MiB)]) as channel:
        locate = channel.unary_unary("/fabric.v1.Fabric/Locate", request_serializer=None, response_deserializer=fabric_pb2.LocateResponse.FromString)
        locate(raw, timeout=60)  # answered: the digest is well-formed, the unknown field dropped
    assert log_bytes(node) - before < LOG_BYTES_PER_REQUEST


def test_data_channel_hello_is_held_to_the_same_bounds(nodes):
    """The data channel's DataHello (raw TCP beside gRPC) is checked against the same table before it is used or logged."""
    node, _ = nodes
    marker = "data channel on port "
    port = int(node.banner[node.banner.index(marker) + len(marker) :].split(",")[0].split(")")[0])
    hello = fabric_pb2.DataHello(fetch=fabric_pb2.FetchRequest(digest="d" * (512 << 10)))
    before = log_bytes(node)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data_frames.encode_hello(hello))
        data = bytearray()
        while chunk := sock.recv(1 << 16):
            data += chunk
    kind, _, length = data_frames.parse_frame_header(bytes(data[: data_frames.FRAME.size]))
    assert kind == data_frames.ERROR
    error = error_from_detail(bytes(data[data_frames.FRAME.size : data_frames.FRAME.size + length]))
    assert isinstance(error, FieldTooLarge) and "FetchRequest.digest" in str(error) and "1024" in str(error), error
    assert log_bytes(node) - before < LOG_BYTES_PER_REQUEST


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---------------------------------------------------------------- every string field of every RPC

SERVICE = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]


def string_paths(message: Descriptor, prefix: tuple[str, ...] = (), depth: int = 0) -> Iterator[tuple[tuple[str, ...], FieldDescriptor]]:
    """Every string field reachable through singular message fields (and repeated strings, one entry)."""
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            yield prefix + (field.name,), field
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated and depth < 3:
            yield from string_paths(field.message_type, prefix + (field.name,), depth + 1)


CASES = [(method.name, path, field) for method in SERVICE.methods for path, field in string_paths(method.input_type)]


def build_request(method_name: str, path: tuple[str, ...], field: FieldDescriptor, value: str):
    method = SERVICE.methods_by_name[method_name]
    request = getattr(fabric_pb2, method.input_type.name)()
    target = request
    for name in path[:-1]:
        target = getattr(target, name)
    if field.is_repeated:
        getattr(target, path[-1]).append(value)
    else:
        setattr(target, path[-1], value)
    if method_name == "Stage":
        return request, lambda stub, timeout: stub.Stage(iter([request]), timeout=timeout)
    if method_name == "Fetch":
        return request, lambda stub, timeout: list(stub.Fetch(request, timeout=timeout))
    if method_name == "StageMany":
        return request, lambda stub, timeout: list(stub.StageMany(iter([request]), timeout=timeout))
    return request, lambda stub, timeout: getattr(stub, method_name)(request, timeout=timeout)


values = st.one_of(
    st.tuples(st.integers(1, 2 * MiB), st.sampled_from(["a", "\n", "\x1b[31m", "\x00", "é", "/"])).map(lambda t: ("over", t)),
    st.text(alphabet=st.sampled_from(CONTROL + "a/.-:0"), min_size=1, max_size=64).map(lambda s: ("control", s)),
)


def test_cases_cover_every_rpc():
    with_strings = {m.name for m in SERVICE.methods if any(string_paths(m.input_type))}
    assert {name for name, _, _ in CASES} == with_strings and len(with_strings) >= 10


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), value=values)
def test_random_strings_in_every_field_get_a_named_refusal_or_an_answer(nodes, stub, case, value):
    node, _ = nodes
    method_name, path, field = case
    kind, raw = value
    bound = BOUNDS[field.full_name].length
    text = (raw[1] * (bound + raw[0]))[: bound + raw[0]] if kind == "over" else raw
    before = log_bytes(node)
    _, call = build_request(method_name, path, field, text)
    try:
        call(stub, 30)
    except grpc.RpcError as error:
        assert error.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method_name, path, error.details()[:300])
        if kind == "over":
            check_named(error, f"{field.containing_type.name}.{field.name}", bound)
        assert len(error.details() or "") < 4096
    else:
        assert kind == "control", f"{method_name} {'.'.join(path)} of {len(text)} characters was answered"
    assert log_bytes(node) - before < LOG_BYTES_PER_REQUEST
    answering(stub)
