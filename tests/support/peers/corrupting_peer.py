"""A hostile peer for tests: relays a real node but flips one byte in chosen Fetch chunks.

    python tests/support/peers/corrupting_peer.py UPSTREAM [--times N]

It is a separate gRPC server process speaking fabric.v1 (GetManifest and Fetch
only, relayed to UPSTREAM), so the receiving node sees a real peer on the wire.
The first chunk of each of the first N Fetch streams has one bit flipped;
later streams are clean. It prints "listening on HOST:PORT" when ready.
"""

from __future__ import annotations

import argparse
import threading

import grpc

from adapter_fabric.transport import wire
from _relay import serve
from adapter_fabric.v1 import fabric_pb2_grpc


class CorruptingRelay(fabric_pb2_grpc.FabricServicer):
    def __init__(self, upstream: str, times: int) -> None:
        self.channel = grpc.insecure_channel(upstream, options=wire.CHANNEL_OPTIONS)
        self.stub = fabric_pb2_grpc.FabricStub(self.channel)
        self.fetch = wire.fetch_stub(self.channel)
        self.remaining = times
        self.lock = threading.Lock()

    def GetManifest(self, request, context):
        return self.stub.GetManifest(request)

    def Fetch(self, request, context):
        first = True
        for offset, data in self.fetch(request):
            if first:
                first = False
                with self.lock:
                    corrupt = self.remaining > 0
                    self.remaining -= int(corrupt)
                if corrupt:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x01
                    print(f"flipped a bit in the chunk at offset {offset}", flush=True)
            yield wire.encode_chunk(offset, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    parser.add_argument("--times", type=int, default=1)
    args = parser.parse_args()
    serve(CorruptingRelay(args.upstream, args.times))


if __name__ == "__main__":
    main()
