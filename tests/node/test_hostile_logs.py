"""Issue 18, item 6: no input forges a log line: control characters are escaped in the text and json formats.

A Promote names a peer address holding a newline and a forged record
(timestamp, level, logger), ESC, NUL and backspace; the node tries that peer,
fails, and logs the failure. Every line of its log is then one of its own
records, and the address appears only escaped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.observability.logs import escape_controls
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

pytestmark = pytest.mark.timeout(180)

FORGED = "2026-01-01 00:00:00,000 INFO node.forged: all adapters verified"
HOST = f"127.0.0.1\n{FORGED}\x1b[2J\x00\x08"
PEER = HOST + ":1"


@pytest.fixture(scope="module", params=["text", "json"])
def node(request, tmp_path_factory) -> Iterator[LocalNode]:
    node = LocalNode(tmp_path_factory.mktemp(request.param) / "node", model="none", extra_args=["--log-format", request.param])
    node.fmt = request.param
    node.start()
    try:
        yield node
    finally:
        node.stop()


def promote_from_forged_peer(node: LocalNode) -> grpc.RpcError:
    with grpc.insecure_channel(node.address) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Promote(fabric_pb2.PromoteRequest(peer=PEER, adapter_id="team/a", stage_only=True, named_peer_only=True), timeout=60)
        stub.ListAdapters(fabric_pb2.ListAdaptersRequest(), timeout=30)  # still answering
    return info.value


def test_peer_address_with_newline_forges_no_log_line(node):
    error = promote_from_forged_peer(node)
    assert error.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    text = Path(node.log_path).read_text(errors="replace")
    for control in ("\x1b", "\x00", "\x08"):
        assert control not in text
    lines = text.splitlines()
    assert not any(line.startswith(FORGED[:10]) for line in lines), [line for line in lines if line.startswith(FORGED[:10])]
    if node.fmt == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(records) == len([line for line in lines if line.strip()])  # every line one object
        assert any(FORGED in record["message"] for record in records)  # the address, whole, inside one record
    else:
        assert escape_controls(HOST) in text  # the address is logged, escaped


def test_escape_controls_names_each_character():
    assert escape_controls("a\nb\x1b\x00\x08\u2028") == "a\\nb\\x1b\\x00\\x08\\u2028"
