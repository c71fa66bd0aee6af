"""The plain-HTTP listener beside a node's gRPC port: ``/metrics``, ``/healthz``, ``/readyz``.

Plain HTTP on purpose: a kubelet probe or a Prometheus scraper needs no client
certificate, while every Fabric RPC stays behind mTLS on the gRPC port. It
serves only what these three paths say (nothing of the store or the model).

Anyone who reaches the port may connect, so it holds no one for long: a
connection that sends nothing for ``READ_TIMEOUT_S`` (``--metrics-read-timeout``) is closed, at most
``MAX_CONNECTIONS`` are served at once (more are closed at once, so threads
and file descriptors stay bounded and gRPC never runs out of them), and a
client that hangs up is one debug log record, never a traceback on stderr.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST

from adapter_fabric.observability import metrics

log = logging.getLogger(__name__)

#: seconds a connection may stay silent (mid-request or between requests) before it is closed (fabric-node --metrics-read-timeout)
READ_TIMEOUT_S = 10.0
#: connections served at once; a probe and a scraper need a few
MAX_CONNECTIONS = 32


class ProbeEndpoint:
    """Serves the three paths on ``host:port`` from a daemon thread; ``ready()`` decides /readyz."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool], read_timeout: float = READ_TIMEOUT_S) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout  # socketserver sets it on the connection: reads past it end the connection

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
            # socketserver's listen backlog is 5: a burst of connections (probes, scrapers, or a flood past the bound)
            # overflows it and each dropped SYN waits a 1 s retransmit; a deeper queue lets the bound below decide instead
            request_queue_size = 128
            slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

            def process_request(self, request, client_address) -> None:
                if not self.slots.acquire(blocking=False):
                    log.debug("metrics endpoint: %s closed, %d connections are open already", client_address, MAX_CONNECTIONS)
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    self.slots.release()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    self.slots.release()

            def handle_error(self, request, client_address) -> None:
                """A client that hung up is routine; anything else is logged as one record (never a raw traceback)."""
                exc = sys.exc_info()[1]
                if isinstance(exc, (ConnectionError, TimeoutError)):
                    log.debug("metrics endpoint: %s went away: %s", client_address, exc)
                else:
                    log.warning("metrics endpoint: a request from %s failed", client_address, exc_info=True)

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
