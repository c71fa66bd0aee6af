"""Servers that record what reaches them: every call's metadata (gRPC), or every data channel hello (TCP).

A test points a node (or a client library object) at them to see which
credentials left for an address: the bearer token, the caller a member names
(``fabric-on-behalf-of``), nothing. They answer nothing useful: every gRPC call
is UNIMPLEMENTED and a data channel connection is closed after its hello.
"""

from __future__ import annotations

import socket
import threading
from concurrent import futures

import grpc

from adapter_fabric.errors import FabricError
from adapter_fabric.transport import data_frames
from adapter_fabric.v1 import fabric_pb2


class HeaderRecorder(grpc.GenericRpcHandler):
    """A real gRPC server on a free loopback port recording ``(method, metadata)`` of every call it receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[self])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def service(self, details: grpc.HandlerCallDetails):
        with self._lock:
            self.calls.append((details.method, {key: str(value) for key, value in details.invocation_metadata or ()}))
        return None  # UNIMPLEMENTED

    def headers(self, key: str) -> list[str]:
        """Every value ``key`` had on the calls received so far."""
        with self._lock:
            return [metadata[key] for _, metadata in self.calls if key in metadata]

    def __enter__(self) -> "HeaderRecorder":
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None)


class HelloRecorder:
    """A TCP listener on a free loopback port keeping the ``DataHello`` of each data channel connection, then closing it."""

    def __init__(self) -> None:
        self.hellos: list[fabric_pb2.DataHello] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self.received = threading.Event()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    prefix = _read(conn, data_frames.HELLO_PREFIX.size)
                    self.hellos.append(data_frames.decode_hello(_read(conn, data_frames.hello_length(prefix))))
                except (OSError, FabricError):  # a connection that sent no whole hello: nothing to keep
                    pass
                self.received.set()

    def __enter__(self) -> "HelloRecorder":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError("closed")
        data += more
    return data
