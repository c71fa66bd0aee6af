"""A hostile peer for tests: relays a real node but lies in its manifests.

    python tests/support/peers/lying_peer.py UPSTREAM --mode {size,digest,content_id,other_id,chunks}

A separate gRPC server process speaking fabric.v1 (GetManifest and Fetch,
relayed to UPSTREAM), so the receiving node sees a real peer on the wire:

- size: the weights file is said to be one byte longer than it is;
- digest: the adapter digest is changed (it no longer matches the file digests);
- content_id: the content id is off by one;
- other_id: the manifest answers for another adapter id;
- chunks: the first chunk's bytes are altered and the manifest carries their
  digest, so every chunk would verify; but the weights root is built over the
  chunk digests (digest scheme 2), so the manifest itself gives the lie away
  before a byte moves.

It prints "listening on HOST:PORT" when ready.
"""

from __future__ import annotations

import argparse
import hashlib

import grpc
from blake3 import blake3

from adapter_fabric.transport import wire
from _relay import serve
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

MODES = ("size", "digest", "content_id", "other_id", "chunks")


def _tamper(data: bytes | memoryview) -> bytes:
    altered = bytearray(data)
    altered[-1] ^= 0x01  # the last byte of the chunk: in the data section, so the header still parses
    return bytes(altered)


class LyingRelay(fabric_pb2_grpc.FabricServicer):
    def __init__(self, upstream: str, mode: str) -> None:
        channel = grpc.insecure_channel(upstream, options=wire.CHANNEL_OPTIONS)
        self.stub = fabric_pb2_grpc.FabricStub(channel)
        self.fetch = wire.fetch_stub(channel)
        self.mode = mode

    def GetManifest(self, request, context):
        manifest = self.stub.GetManifest(request)
        weights = manifest.files[1]
        if self.mode == "size":
            weights.size += 1
        elif self.mode == "digest":
            manifest.digest = hashlib.sha256(manifest.digest.encode()).hexdigest()
        elif self.mode == "content_id":
            manifest.content_id ^= 1
        elif self.mode == "other_id":
            manifest.adapter_id = manifest.adapter_id + "-other"
        elif self.mode == "chunks":
            first = next(iter(self.fetch(fabric_pb2.FetchRequest(digest=manifest.digest, file=weights.name, length=weights.chunk_size))))
            weights.chunk_digests[0] = blake3(_tamper(first[1])).digest()
        return manifest

    def Fetch(self, request, context):
        for offset, data in self.fetch(request):
            if self.mode == "chunks" and offset == 0:
                data = _tamper(data)
            yield wire.encode_chunk(offset, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    parser.add_argument("--mode", choices=MODES, required=True)
    args = parser.parse_args()
    serve(LyingRelay(args.upstream, args.mode))


if __name__ == "__main__":
    main()
