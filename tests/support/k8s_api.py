"""A Kubernetes API server's EndpointSlice list and watch, over real HTTP: what the ``kubernetes`` client reads.

Only ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` (with ``labelSelector``), answered as the API
server answers it: a list with a ``resourceVersion``, or with ``watch=true`` a chunked stream of JSON events from the
given ``resourceVersion`` on (an expired one is answered by an ERROR event with code 410, as the server does). No
etcd, no admission, no RBAC: no real API server installs here, so those lines of ``SliceWatch`` (in-cluster config,
the service account's token, RBAC refusals) run against a real cluster only.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


def endpoint_slice(name: str, service: str, addresses: list[str], port: int, ready: bool = True, port_name: str = "grpc") -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "fabric", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a in addresses],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


class FakeSliceApi:
    """Holds slices by name; ``put``/``delete`` bump the resourceVersion and reach every open watch."""

    def __init__(self) -> None:
        self.version = 1
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []  # (version, type, object)
        self.oldest = 1  # versions before this one are expired (410)
        self.watches = 0
        self.generation = 0  # bumped to end every open watch
        self.cond = threading.Condition()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeSliceApi:
        self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "fabric"}}],
            "users": [{"name": "fake", "user": {"token": "unused"}}],
        }))  # fmt: skip
        return path

    def _change(self, kind: str, obj: dict) -> None:
        with self.cond:
            self.version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.events.append((self.version, kind, obj))
            self.cond.notify_all()

    def put(self, obj: dict) -> None:
        kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
        self.slices[obj["metadata"]["name"]] = obj
        self._change(kind, obj)

    def delete(self, name: str) -> None:
        self._change("DELETED", self.slices.pop(name))

    def expire(self) -> None:
        """Every version so far is too old to watch from (an etcd compaction), and the open watches end (the API server
        restarted): a client resuming from its last version is answered 410 Gone."""
        with self.cond:
            self.oldest = self.version + 1
            self.generation += 1
            self.cond.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                if not url.path.startswith("/apis/discovery.k8s.io/v1/namespaces/") or not url.path.endswith("/endpointslices"):
                    self.send_error(404)
                    return
                selector = query.get("labelSelector", [""])[0]
                wanted = selector.split("=", 1)[1] if "=" in selector else ""
                if query.get("watch", ["false"])[0].lower() in ("true", "1"):
                    self._watch(int(query.get("resourceVersion", ["0"])[0] or 0), wanted)
                    return
                with api.cond:
                    items = [s for s in api.slices.values() if s["metadata"]["labels"]["kubernetes.io/service-name"] == wanted]
                    body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                       "metadata": {"resourceVersion": str(api.version)}, "items": items}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, since: int, wanted: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                with api.cond:
                    api.watches += 1
                    api.cond.notify_all()
                    sent, generation = since, api.generation
                    try:
                        while not getattr(api, "closed", False) and generation == api.generation:
                            if sent < api.oldest - 1:
                                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                                          "message": f"too old resource version: {sent}"}  # fmt: skip
                                self._chunk(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
                                break
                            for version, kind, obj in [e for e in api.events if e[0] > sent]:
                                sent = version
                                if obj["metadata"]["labels"]["kubernetes.io/service-name"] == wanted:
                                    self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                            api.cond.wait(1.0)
                        self._chunk(b"")
                    except OSError:
                        pass

        return Handler
