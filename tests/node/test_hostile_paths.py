"""Issue 18, item 7: a refusal names the adapter, never the node's own file paths.

Every malformed weights file of the hostile corpus is staged on a real node
over gRPC; each refusal's message (what the CLI prints) must not hold the
node's store path nor its ``uploads/`` layout, and the header refusals name
the adapter id instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from adapter_fabric.errors import InvalidHeader
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.serving.tiny import build_tiny_model
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.hostile_corpus import ALL_ADAPTER_CASES, WEIGHTS, build_adapters
from tests.support.store import stage_begin

pytestmark = pytest.mark.timeout(300)

STAGE_CASES = [c.name for c in ALL_ADAPTER_CASES if c.refused_at == "stage" and c.name not in {"config_missing", "weights_missing"}]
PIECE = 64 << 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    return build_adapters(tmp_path_factory.mktemp("corpus"), build_tiny_model())


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[LocalNode]:
    with LocalNode(tmp_path_factory.mktemp("paths") / "node", model="none") as node:
        yield node


def stage_refusal(node: LocalNode, adapter_dir: Path, adapter_id: str) -> grpc.RpcError:
    data = (adapter_dir / WEIGHTS).read_bytes()
    messages = [fabric_pb2.StageRequest(begin=stage_begin(adapter_dir, adapter_id))]
    messages += [fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=i, data=data[i : i + PIECE])) for i in range(0, len(data), PIECE)]
    with grpc.insecure_channel(node.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            fabric_pb2_grpc.FabricStub(channel).Stage(iter(messages), timeout=60)
    return info.value


@pytest.mark.parametrize("name", STAGE_CASES)
def test_stage_refusal_names_no_node_path(name, corpus, node):
    if not (corpus[name] / WEIGHTS).exists():
        pytest.skip("no weights file to send")
    adapter_id = f"hostile/{name}"
    error = stage_refusal(node, corpus[name], adapter_id)
    message = error.details()
    for leak in (str(node.store), str(node.store.parent), "uploads/", "partial/", "/data:"):
        assert leak not in message, f"{name}: {message}"
    if isinstance(error_from_rpc(error), InvalidHeader):
        assert adapter_id in message, message  # the header refusal says whose header it is
