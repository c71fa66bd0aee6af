"""What every test relay peer shares: serve a relaying servicer on a free loopback port."""

from __future__ import annotations

from concurrent import futures

import grpc

from adapter_fabric.transport import wire


def serve(servicer) -> None:
    """Serve ``servicer`` (fabric.v1, raw Fetch path) and print "listening on HOST:PORT" for the test to read."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=wire.SERVER_OPTIONS)
    wire.add_fabric_servicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()
