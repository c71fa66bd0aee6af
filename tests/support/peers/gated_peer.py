"""A test peer that relays a real node one chunk at a time and holds at a chosen chunk until the test says go.

    python tests/support/peers/gated_peer.py UPSTREAM --hold-after N [--chunk-size BYTES]

A separate gRPC server process speaking fabric.v1. GetManifest and
Availability are relayed to UPSTREAM. A Fetch is relayed as one upstream
Fetch per chunk, so what changes upstream (an unstage) shows on the very next
chunk, not after a stream UPSTREAM opened before the change (that stream goes
on from the file it opened). The chunk size and file size come from the
manifests it relays, or, for a digest whose manifest the caller got
elsewhere, from --chunk-size and the request's length. Once N chunks in all have been sent, it prints
"holding after N chunks" and sends nothing more until a line arrives on its
stdin; then it goes on. An upstream refusal is passed on with its code,
details and trailing metadata. It prints "listening on HOST:PORT" when ready.
"""

from __future__ import annotations

import argparse
import sys
import threading

import grpc

from adapter_fabric.transport import wire
from _relay import serve
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc


class GatedRelay(fabric_pb2_grpc.FabricServicer):
    def __init__(self, upstream: str, hold_after: int, chunk_size: int) -> None:
        channel = grpc.insecure_channel(upstream, options=wire.CHANNEL_OPTIONS)
        self.stub = fabric_pb2_grpc.FabricStub(channel)
        self.fetch = wire.fetch_stub(channel)
        self.hold_after = hold_after
        self.chunk_size = chunk_size
        self.sent = 0
        self.lock = threading.Lock()
        self.go = threading.Event()
        self.files: dict[tuple[str, str], tuple[int, int]] = {}  # (digest, file) -> (size, chunk size), from the manifests relayed

    def GetManifest(self, request, context):
        manifest = self._relay(self.stub.GetManifest, request, context)
        for entry in manifest.files:
            self.files[(manifest.digest, entry.name)] = (entry.size, entry.chunk_size)
        return manifest

    def Availability(self, request, context):
        return self._relay(self.stub.Availability, request, context)

    def Fetch(self, request, context):
        size, chunk = self.files.get((request.digest, request.file), (None, self.chunk_size))
        offset = request.offset
        if request.length:
            end = request.offset + request.length if size is None else min(size, offset + request.length)
        elif size is not None:
            end = size
        else:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "gated_peer: a Fetch to the end of a file whose manifest it never relayed")
        while offset < end:
            with self.lock:
                hold = self.sent == self.hold_after
                self.sent += 1
            if hold:
                print(f"holding after {self.hold_after} chunks", flush=True)
                self.go.wait()
            one = fabric_pb2.FetchRequest(digest=request.digest, file=request.file, offset=offset, length=min(chunk, end - offset))
            try:
                for got, data in self.fetch(one):
                    yield wire.encode_chunk(got, data)
            except grpc.RpcError as exc:
                context.set_trailing_metadata(exc.trailing_metadata() or ())
                context.abort(exc.code(), exc.details())
            offset += chunk

    @staticmethod
    def _relay(method, request, context):
        try:
            return method(request)
        except grpc.RpcError as exc:
            context.set_trailing_metadata(exc.trailing_metadata() or ())
            context.abort(exc.code(), exc.details())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    parser.add_argument("--hold-after", type=int, required=True)
    parser.add_argument("--chunk-size", type=int, default=4096, help="for digests whose manifest it did not relay")
    args = parser.parse_args()
    relay = GatedRelay(args.upstream, args.hold_after, args.chunk_size)
    threading.Thread(target=lambda: (sys.stdin.readline(), relay.go.set()), daemon=True).start()
    serve(relay)


if __name__ == "__main__":
    main()
