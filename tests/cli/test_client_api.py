"""Issue 33, the Python user: NodeClient's deadlines, a closed client, ``timeout=`` semantics, the top-level exports."""

from __future__ import annotations

import os
import signal
import socket

import pytest

import adapter_fabric
from adapter_fabric import ClientClosed, DeadlineExceeded, FabricError, InvalidArgument, NodeClient, PeerUnavailable
from adapter_fabric.harness.cluster import LocalNode, free_port


@pytest.fixture
def silent() -> str:
    """A listener that accepts connections and never answers (a node frozen mid-call looks the same to a client)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_client_deadline_is_deadline_exceeded_and_still_a_peer_unavailable(silent) -> None:
    with NodeClient(silent) as client:
        with pytest.raises(DeadlineExceeded, match=f"node {silent} did not answer in time") as caught:
            client.list(timeout=0.3)
        assert isinstance(caught.value, PeerUnavailable) and caught.value.retryable  # old `except PeerUnavailable` still catches it
        with pytest.raises(DeadlineExceeded):
            client.pull("a/b", peer="127.0.0.1:2", timeout=0.3)  # a call that moves an adapter: its own timeout too


@pytest.mark.slow
def test_deadline_exceeded_against_a_stopped_node(tmp_path) -> None:
    node = LocalNode(tmp_path / "n", model="none", port=free_port()).start()
    try:
        os.kill(node.pid, signal.SIGSTOP)  # stopped: its port accepts, nothing answers
        try:
            with NodeClient(node.address) as client, pytest.raises(DeadlineExceeded, match="did not answer in time"):
                client.store_status(timeout=1)
        finally:
            os.kill(node.pid, signal.SIGCONT)
    finally:
        node.stop()


def test_a_closed_client_raises_a_fabric_error_naming_it(silent) -> None:
    client = NodeClient(silent)
    client.close()
    for call in (client.list, client.health, lambda: client.promote("a/b"), lambda: client.wait_serving(timeout=1)):
        with pytest.raises(ClientClosed, match=f"NodeClient of {silent} is closed") as caught:
            call()
        assert isinstance(caught.value, FabricError)
    with NodeClient(silent) as scoped:
        pass
    with pytest.raises(ClientClosed, match="with block ended"):
        scoped.list()


def test_timeout_none_is_the_clients_own_and_zero_is_none(silent) -> None:
    """None: the client's (quick or long) deadline; 0: no deadline; a number: that call's; nonsense refused by name."""
    with NodeClient(silent, timeout=7.0, long_timeout=99.0) as client:
        assert (client._quick(None), client.long_deadline(None)) == (7.0, 99.0)
        assert (client._quick(0), client.long_deadline(0)) == (None, None)
        assert (client._quick(2), client.long_deadline(2.5)) == (2.0, 2.5)
        assert client.long_deadline(False) == 99.0  # what False meant before (the default): kept for old callers
        for bad in (-1, float("nan"), True, "30s"):
            with pytest.raises(InvalidArgument, match="timeout="):
                client.long_deadline(bad)
    with NodeClient(silent, long_timeout=None) as unbounded:
        assert unbounded.long_deadline(None) is None


def test_the_top_level_exports_what_the_methods_return_and_nothing_else() -> None:
    shown = dir(adapter_fabric)
    for name in ("Identity", "Location", "ActiveSlot", "StoreStatus", "SlotInfo", "StagedAdapter", "ClientClosed", "DeadlineExceeded"):
        assert name in adapter_fabric.__all__ and name in shown and getattr(adapter_fabric, name).__name__ == name
    for helper in ("Any", "TYPE_CHECKING", "importlib", "annotations"):
        assert helper not in shown, helper
    assert set(adapter_fabric.__all__) <= set(shown)


def test_store_status_reads_every_list_the_reply_carries() -> None:
    """Each result type of StoreStatus is built from its message (OriginState was left without its dataclass by a merge)."""
    from adapter_fabric.v1 import fabric_pb2

    reply = fabric_pb2.StoreStatusResponse(
        used_bytes=10, origins=[fabric_pb2.OriginState(origin="s3://bucket/x", answering=False, error="timed out", since=5.0)],
        recent_evictions=[fabric_pb2.Eviction(adapter_ids=["b"], digest="d" * 64, bytes=7, age_seconds=1.5, reason="downloading 'c'")],
    )
    status = adapter_fabric.StoreStatus.from_proto(reply)
    (origin,) = status.origins
    assert (origin.origin, origin.answering, origin.error, origin.since) == ("s3://bucket/x", False, "timed out", 5.0)
    (evicted,) = status.recent_evictions
    assert (evicted.adapter_ids, evicted.bytes, evicted.reason) == (["b"], 7, "downloading 'c'")
