"""A hostile peer for tests: relays a real node, then stops sending in the middle of every Fetch.

    python tests/support/peers/stalling_peer.py UPSTREAM [--chunks N]

A separate gRPC server process speaking fabric.v1 (GetManifest relayed to
UPSTREAM, Fetch relayed until N chunks in all have been sent, over however
many streams a swarm puller opens). After those every stream stays open and
sends nothing, as a peer with a hung disk or a wedged process would, until
the receiver cancels. It prints "listening on HOST:PORT" when
ready and "stalled after N chunks" each time a stream goes quiet.
"""

from __future__ import annotations

import argparse
import threading
import time

import grpc

from adapter_fabric.transport import wire
from _relay import serve
from adapter_fabric.v1 import fabric_pb2_grpc


class StallingRelay(fabric_pb2_grpc.FabricServicer):
    def __init__(self, upstream: str, chunks: int) -> None:
        channel = grpc.insecure_channel(upstream, options=wire.CHANNEL_OPTIONS)
        self.stub = fabric_pb2_grpc.FabricStub(channel)
        self.fetch = wire.fetch_stub(channel)
        self.remaining = chunks
        self.lock = threading.Lock()

    def GetManifest(self, request, context):
        return self.stub.GetManifest(request)

    def Fetch(self, request, context):
        upstream = self.fetch(request)
        for offset, data in upstream:
            with self.lock:
                allowed = self.remaining > 0
                self.remaining -= int(allowed)
            if not allowed:
                upstream.cancel()
                break
            yield wire.encode_chunk(offset, data)
        else:
            return  # the whole range fit in the budget
        print(f"stalled at offset {offset}: the chunk budget is spent", flush=True)
        while context.is_active():  # silent, but the stream stays open until the receiver gives up
            time.sleep(0.05)
        print("receiver cancelled the stalled stream", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    parser.add_argument("--chunks", type=int, default=3)
    args = parser.parse_args()
    serve(StallingRelay(args.upstream, args.chunks))


if __name__ == "__main__":
    main()
