"""A test peer in front of a real (durable) node that takes a Promote and holds it until the test says go.

    python tests/support/peers/holding_peer.py UPSTREAM

A separate gRPC server process speaking fabric.v1. Availability and
GetManifest are relayed to UPSTREAM, so a durable UPSTREAM is seen as durable
here. A Promote (an evicting node's hand-off of a last copy) is held: the
relay prints "holding a Promote of ID" and waits for a line on its stdin, then
relays the Promote to UPSTREAM (which pulls the adapter from the node it
names) and answers what UPSTREAM answered. It prints "listening on HOST:PORT"
when ready.
"""

from __future__ import annotations

import argparse
import sys
import threading

import grpc

from _relay import serve
from adapter_fabric.transport import wire
from adapter_fabric.v1 import fabric_pb2_grpc


class HoldingRelay(fabric_pb2_grpc.FabricServicer):
    def __init__(self, upstream: str) -> None:
        self.stub = fabric_pb2_grpc.FabricStub(grpc.insecure_channel(upstream, options=wire.CHANNEL_OPTIONS))
        self.go = threading.Event()

    def Availability(self, request, context):
        return self._relay(self.stub.Availability, request, context)

    def GetManifest(self, request, context):
        return self._relay(self.stub.GetManifest, request, context)

    def Promote(self, request, context):
        print(f"holding a Promote of {request.adapter_id}", flush=True)
        self.go.wait()
        return self._relay(self.stub.Promote, request, context)

    def _relay(self, call, request, context):
        try:
            return call(request, timeout=300)
        except grpc.RpcError as exc:
            context.set_trailing_metadata(exc.trailing_metadata() or ())
            context.abort(exc.code(), exc.details())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    args = parser.parse_args()
    relay = HoldingRelay(args.upstream)
    threading.Thread(target=lambda: (sys.stdin.readline(), relay.go.set()), daemon=True).start()
    serve(relay)


if __name__ == "__main__":
    main()
