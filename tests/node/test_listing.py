"""Issue 19: ListAdapters pages (page_size, page_token, next_page_token); the client and ``fabric ls`` page through every entry.

A real node process; the CLI runs as its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from adapter_fabric.node.slots import MAX_PAGE_SIZE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

IDS = sorted(f"page/{i:02d}" for i in range(7))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("listing")
    adapter = make_peft_adapter(root / "a", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj"], seed=9)
    node = LocalNode(root / "n", model="none").start()
    try:
        with node.client() as c:
            for adapter_id in IDS:
                c.stage(adapter, adapter_id)
        yield node
    finally:
        node.stop()


def test_the_client_pages_through_every_entry(node) -> None:
    with node.client() as c:
        pages = list(c.list_pages(page_size=3))
        assert [[a.adapter_id for a in page.staged] for page in pages] == [IDS[0:3], IDS[3:6], IDS[6:]]
        assert [a.adapter_id for a in c.list(page_size=3).staged] == IDS
        assert [a.adapter_id for a in c.list().staged] == IDS  # the default page holds them all
        with pytest.raises(InvalidArgument, match="page_size"):
            c.list(page_size=-1)


def test_fabric_ls_pages_through_every_entry(node) -> None:
    done = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "ls", node.address, "--page-size", "2", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [a["adapter_id"] for a in json.loads(done.stdout)["staged"]] == IDS
    text = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "ls", node.address, "--page-size", "2"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and f"staged ({len(IDS)}):" in text.stdout, text.stdout + text.stderr


def test_a_page_is_bounded_and_a_bad_token_is_refused(node) -> None:
    with grpc.insecure_channel(node.address) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        reply = stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_size=MAX_PAGE_SIZE * 10))  # past the maximum: taken as the maximum, not refused
        assert [a.adapter_id for a in reply.staged] == IDS and reply.next_page_token == ""
        first = stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_size=1))
        assert [a.adapter_id for a in first.staged] == IDS[:1] and first.next_page_token
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_token="../not-a-token"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in refused.value.details()
