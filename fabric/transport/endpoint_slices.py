"""Members from a Kubernetes Service's EndpointSlices, watched through the maintained client (``kubernetes``).

``--peers-k8s [NAMESPACE/]SERVICE:PORT`` lists the Service's EndpointSlices once (their ``resourceVersion``), then
watches them from there: a pod that becomes ready or ends changes the members within a watch event, not at the next
poll. Each ready endpoint address is a member at the slice's port named PORT (or numbered PORT); an endpoint whose
``ready`` condition is false (terminating, failing its readiness probe) is not. A watch that ends is resumed from its
last ``resourceVersion``; one the server expired (410 Gone) lists again; a server that cannot be reached keeps the
last members and is asked again after ``RETRY_S``. The node needs ``get``/``list``/``watch`` on
``endpointslices.discovery.k8s.io`` in its namespace (deploy/rbac.yaml).

``slice_members`` and ``SliceTable`` are the view logic, over the client's own model objects (``V1EndpointSlice``);
``SliceWatch`` is the I/O, on a thread of its own (the client is blocking).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from adapter_fabric.errors import InvalidArgument

__all__ = ["RETRY_S", "SliceTable", "SliceTarget", "SliceWatch", "parse_target", "slice_members"]

log = logging.getLogger(__name__)

#: the label every EndpointSlice of a Service carries
SERVICE_LABEL = "kubernetes.io/service-name"
#: seconds before a watch that failed (server unreachable, refused) is tried again
RETRY_S = 5.0
#: seconds a watch call asks the server to stay open (then it is resumed from its resourceVersion)
WATCH_S = 300
#: where a pod finds its own namespace
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class SliceTarget:
    """``[NAMESPACE/]SERVICE:PORT``: the Service whose ready endpoints are members, and the port (a name or a number)."""

    def __init__(self, namespace: str, service: str, port: str) -> None:
        self.namespace, self.service, self.port = namespace, service, port

    def __repr__(self) -> str:
        return f"{self.namespace}/{self.service}:{self.port}"


def parse_target(value: str, default_namespace: Callable[[], str] | None = None) -> SliceTarget:
    """``[NAMESPACE/]SERVICE:PORT`` -> SliceTarget; the namespace defaults to the pod's own. Refused by name otherwise."""
    name, sep, port = value.rpartition(":")
    namespace, _, service = name.rpartition("/")
    if not sep or not service or not port or not all(_dns_label(p) for p in (service, *([namespace] if namespace else []))):
        raise InvalidArgument(f"--peers-k8s {value[:200]!r} is not [NAMESPACE/]SERVICE:PORT (for example fabric/fabric-peers:grpc)")
    if not (port.isdigit() and 0 < int(port) < 65536) and not _dns_label(port):
        raise InvalidArgument(f"--peers-k8s port {port[:100]!r} is neither a port number nor a port name")
    return SliceTarget(namespace or (default_namespace or _pod_namespace)(), service, port)


def _dns_label(value: str) -> bool:
    return 0 < len(value) <= 63 and value[0].isalnum() and value[-1].isalnum() and all(c.isalnum() or c == "-" for c in value) and value.islower()


def _pod_namespace() -> str:
    try:
        return POD_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def slice_members(endpoint_slice: Any, port: str) -> frozenset[str]:
    """The ``ip:port`` (``[ip]:port``) of every ready endpoint of one ``V1EndpointSlice``, at its port named or numbered ``port``."""
    number = next((p.port for p in endpoint_slice.ports or () if p.port and (p.name == port or str(p.port) == port)), None)
    if number is None and port.isdigit():
        number = int(port)  # a Service port with no name, given by its number
    if number is None:
        return frozenset()
    v6 = (endpoint_slice.address_type or "").lower() == "ipv6"
    members: set[str] = set()
    for endpoint in endpoint_slice.endpoints or ():
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:
            continue  # terminating or not ready: not a member
        members.update(f"[{a}]:{number}" if v6 else f"{a}:{number}" for a in endpoint.addresses or ())
    return frozenset(members)


class SliceTable:
    """A Service's EndpointSlices by name, as the watch saw them; ``members`` is their union."""

    def __init__(self, port: str) -> None:
        self.port = port
        self._slices: dict[str, frozenset[str]] = {}

    def replace(self, slices: Iterable[Any]) -> None:
        """A fresh list: every slice it names, and no other."""
        self._slices = {s.metadata.name: slice_members(s, self.port) for s in slices}

    def apply(self, kind: str, endpoint_slice: Any) -> None:
        """One watch event: ADDED, MODIFIED or DELETED (BOOKMARK and anything else change nothing)."""
        name = endpoint_slice.metadata.name
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = slice_members(endpoint_slice, self.port)
        elif kind == "DELETED":
            self._slices.pop(name, None)

    def members(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())


class SliceWatch:
    """Lists, then watches, a Service's EndpointSlices on a thread of its own; calls ``on_members`` with each new union."""

    def __init__(self, target: SliceTarget, on_members: Callable[[frozenset[str]], None], api: Any = None) -> None:
        """``api``: a ``kubernetes.client.DiscoveryV1Api`` (None: made from the pod's service account, else $KUBECONFIG)."""
        self.target = target
        self.on_members = on_members
        self._api = api
        self._stopped = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="endpoint-slices", daemon=True)
        self.table = SliceTable(target.port)
        #: set once the first list answered (a node waits for it, bounded, before it serves)
        self.listed = threading.Event()

    def start(self) -> SliceWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config  # only a node given --peers-k8s loads it

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._list_and_watch()
            except Exception as exc:  # noqa: BLE001 (the last members stand; asked again shortly)
                if self._stopped.is_set():
                    return
                log.warning("EndpointSlices of %r: %s: %s; keeping the last %d members, trying again in %gs",
                            self.target, type(exc).__name__, str(exc)[:300], len(self.table.members()), RETRY_S)  # fmt: skip
                self._stopped.wait(RETRY_S)

    def _list_and_watch(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api, target = self._client(), self.target
        selector = f"{SERVICE_LABEL}={target.service}"
        listed = api.list_namespaced_endpoint_slice(target.namespace, label_selector=selector)
        self.table.replace(listed.items)
        self.on_members(self.table.members())
        self.listed.set()
        version = listed.metadata.resource_version
        while not self._stopped.is_set():
            self._watch = watch.Watch()
            try:
                for event in self._watch.stream(
                    api.list_namespaced_endpoint_slice, target.namespace, label_selector=selector, resource_version=version,
                    timeout_seconds=WATCH_S, allow_watch_bookmarks=True,
                ):  # fmt: skip
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        raise ApiException(status=getattr(obj, "code", None) or event["raw_object"].get("code"), reason=str(event["raw_object"])[:200])
                    version = obj.metadata.resource_version or version
                    self.table.apply(kind, obj)
                    if kind != "BOOKMARK":
                        self.on_members(self.table.members())
            except ApiException as exc:
                if exc.status == 410:
                    return  # expired: list again
                raise
