"""The plain-HTTP listener beside a node's gRPC port: ``/metrics``, ``/healthz``, ``/readyz``.

Plain HTTP on purpose: a kubelet probe or a Prometheus scraper needs no client
certificate, while every Fabric RPC stays behind mTLS on the gRPC port. It
serves only what these three paths say (nothing of the store or the model).

Anyone who reaches the port may connect, so it holds no one for long: a
connection gets ``READ_TIMEOUT_S`` (``--metrics-read-timeout``) in all to send
a whole request (however slowly it drips one), and as long again between
requests; at most ``MAX_CONNECTIONS`` are served at once, and one more sheds
the oldest still sending its request (a probe's request is whole at once, so a
flood of slow connections never keeps ``/healthz`` from answering), or, when
every one is being answered, is closed at once: threads and file descriptors
stay bounded and gRPC never runs out of them. A client that hangs up is one
debug log record, never a traceback on stderr.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol, cast

from prometheus_client import CONTENT_TYPE_LATEST

from adapter_fabric.observability import metrics

log = logging.getLogger(__name__)

#: seconds a connection may stay silent (mid-request or between requests) before it is closed (fabric-node --metrics-read-timeout)
READ_TIMEOUT_S = 10.0
#: connections served at once; a probe and a scraper need a few
MAX_CONNECTIONS = 32


class _Tracking(Protocol):
    """What the handler tells its server of a connection (the server below bounds and cuts connections by it)."""

    def reading(self, request: socket.socket) -> None: ...

    def answering(self, request: socket.socket) -> None: ...


class ProbeEndpoint:
    """Serves the three paths on ``host:port`` from a daemon thread; ``ready()`` decides /readyz."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool], read_timeout: float = READ_TIMEOUT_S) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout  # socketserver sets it on the connection: reads past it end the connection

            def setup(self) -> None:
                super().setup()
                cast(_Tracking, self.server).reading(self.request)

            def parse_request(self) -> bool:
                whole = super().parse_request()
                if whole:
                    cast(_Tracking, self.server).answering(self.request)  # a whole request: no longer shed, nor cut by its deadline
                return whole

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
                cast(_Tracking, self.server).reading(self.request)  # the next request of a kept-alive connection has its own deadline

            def log_message(self, *args) -> None:  # probes every few seconds would drown the log
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True
            # socketserver's listen backlog is 5: a burst of connections (probes, scrapers, or a flood past the bound)
            # overflows it and each dropped SYN waits a 1 s retransmit; a deeper queue lets the bound below decide instead
            request_queue_size = 128
            lock = threading.Lock()
            #: every connection served, oldest first: when it began its current request (None: being answered)
            connections: dict[socket.socket, float | None] = {}

            def reading(self, request: socket.socket) -> None:
                with self.lock:
                    if request in self.connections:
                        self.connections[request] = time.monotonic()

            def answering(self, request: socket.socket) -> None:
                with self.lock:
                    if request in self.connections:
                        self.connections[request] = None

            def process_request(self, request, client_address) -> None:
                with self.lock:
                    if len(self.connections) >= MAX_CONNECTIONS:
                        oldest = next((r for r, since in self.connections.items() if since is not None), None)
                        if oldest is None:
                            log.debug("metrics endpoint: %s closed, %d connections are being answered", client_address, MAX_CONNECTIONS)
                            self.shutdown_request(request)
                            return
                        self._cut(oldest)  # still sending its request: room for this one
                    self.connections[request] = time.monotonic()
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    with self.lock:
                        self.connections.pop(request, None)
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    with self.lock:
                        self.connections.pop(request, None)

            def service_actions(self) -> None:
                """Every poll of the accept loop (0.5 s): a connection that has not sent a whole request in ``read_timeout`` is cut."""
                stale = time.monotonic() - read_timeout
                with self.lock:
                    for request in [r for r, since in self.connections.items() if since is not None and since < stale]:
                        self._cut(request)

            def _cut(self, request: socket.socket) -> None:
                """End a connection's reads at once (its thread then ends and lets it go); under ``lock``."""
                self.connections.pop(request, None)
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

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

    def start(self) -> ProbeEndpoint:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
