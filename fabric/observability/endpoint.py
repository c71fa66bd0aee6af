"""The plain-HTTP listener beside a node's gRPC port: ``/metrics``, ``/healthz``, ``/readyz``.

Plain HTTP on purpose: a kubelet probe or a Prometheus scraper needs no client
certificate, while every Fabric RPC stays behind mTLS on the gRPC port. It
serves only what these three paths say (nothing of the store or the model).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST

from fabric.observability import metrics


class ProbeEndpoint:
    """Serves the three paths on ``host:port`` from a daemon thread; ``ready()`` decides /readyz."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool]) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, metrics.scrape(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200, b"ok\n")
                elif path == "/readyz":
                    ok = endpoint.ready()
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds would drown the log
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self.ready = ready
        self._server = Server((host.strip("[]"), port), Handler)  # OSError (in use, bad host) goes to the caller
        self._thread = threading.Thread(target=self._server.serve_forever, name="probe-endpoint", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> "ProbeEndpoint":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
