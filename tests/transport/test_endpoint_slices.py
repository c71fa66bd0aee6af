"""Members from EndpointSlices (``adapter_fabric.transport.endpoint_slices``): the view logic over the ``kubernetes``
client's own model objects, and the list-then-watch through that client over HTTP against ``tests.support.k8s_api``
(an API server's list and watch of EndpointSlices; no real API server installs here)."""

from __future__ import annotations

import threading

import pytest
from adapter_fabric.errors import InvalidArgument
from adapter_fabric.transport.endpoint_slices import SliceTable, SliceWatch, parse_target, slice_members

from tests.support.k8s_api import FakeSliceApi, endpoint_slice
from tests.support.waiting import wait_for

kubernetes = pytest.importorskip("kubernetes")


def model(obj: dict):
    """The client's own V1EndpointSlice, deserialised as a watch event's object is."""
    client = kubernetes.client.ApiClient()
    return client._ApiClient__deserialize(obj, "V1EndpointSlice")


def test_ready_endpoints_at_the_named_port_are_members() -> None:
    ready = model(endpoint_slice("s1", "fabric-peers", ["10.0.0.1", "10.0.0.2"], 50051))
    leaving = model(endpoint_slice("s2", "fabric-peers", ["10.0.0.3"], 50051, ready=False))
    assert slice_members(ready, "grpc") == {"10.0.0.1:50051", "10.0.0.2:50051"}
    assert slice_members(ready, "50051") == slice_members(ready, "grpc")
    assert slice_members(ready, "metrics") == frozenset() and slice_members(leaving, "grpc") == frozenset()
    table = SliceTable("grpc")
    table.replace([ready, leaving])
    table.apply("MODIFIED", model(endpoint_slice("s2", "fabric-peers", ["10.0.0.3"], 50051)))
    assert table.members() == {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"}
    table.apply("DELETED", ready)
    table.apply("BOOKMARK", ready)
    assert table.members() == {"10.0.0.3:50051"}


def test_a_target_is_namespace_service_and_port() -> None:
    target = parse_target("fabric/fabric-peers:grpc")
    assert (target.namespace, target.service, target.port) == ("fabric", "fabric-peers", "grpc")
    assert parse_target("fabric-peers:50051", default_namespace=lambda: "ns1").namespace == "ns1"
    for bad in ("fabric-peers", "Fabric:grpc", "a/b/c:1", "x:0", "x:Grpc_1", ":1"):
        with pytest.raises(InvalidArgument, match="--peers-k8s"):
            parse_target(bad)


def test_the_watch_follows_the_service_through_the_client_and_relists_after_an_expiry() -> None:
    api = FakeSliceApi().start()
    try:
        api.put(endpoint_slice("s1", "fabric-peers", ["10.0.0.1"], 50051))
        api.put(endpoint_slice("other", "another-service", ["10.9.9.9"], 50051))
        seen: list[frozenset[str]] = []
        changed = threading.Event()

        def on_members(members: frozenset[str]) -> None:
            seen.append(members)
            changed.set()

        configuration = kubernetes.client.Configuration()
        configuration.host = api.url
        client = kubernetes.client.DiscoveryV1Api(kubernetes.client.ApiClient(configuration))
        watch = SliceWatch(parse_target("fabric/fabric-peers:grpc"), on_members, api=client).start()
        try:
            wait_for(lambda: seen and seen[-1] == {"10.0.0.1:50051"} and api.watches >= 1, what="the listed members and a watch")
            api.put(endpoint_slice("s2", "fabric-peers", ["10.0.0.2"], 50051))
            wait_for(lambda: seen[-1] == {"10.0.0.1:50051", "10.0.0.2:50051"}, what="a slice added")
            api.put(endpoint_slice("s1", "fabric-peers", ["10.0.0.1"], 50051, ready=False))
            wait_for(lambda: seen[-1] == {"10.0.0.2:50051"}, what="an endpoint no longer ready")
            api.expire()  # the watch is answered 410 Gone: the client lists again and watches from there
            api.delete("s2")
            wait_for(lambda: seen[-1] == frozenset() and api.watches >= 2, what="a relist after the expiry")
        finally:
            watch.close()
    finally:
        api.close()
