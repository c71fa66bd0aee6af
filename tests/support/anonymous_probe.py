"""Ask nodes for an adapter with no credential and with one, as a reader of the README could (tests/project/test_readme_more.py).

    python tests/support/anonymous_probe.py ADAPTER_ID TOKEN_FILE NODE [NODE ...]

For each node: GetManifest, Locate and Fetch over gRPC, and a Fetch over the
data channel, each anonymous (no token, no certificate), must be refused
(UNAUTHENTICATED, or on the data channel an Unauthenticated ERROR frame); the
same GetManifest and data channel Fetch with the token in TOKEN_FILE must
succeed, so a refusal is the node's and not a broken probe. It prints one line
per check and exits 1 if any check fails.
"""

from __future__ import annotations

import sys

import grpc

from adapter_fabric.errors import Unauthenticated
from adapter_fabric.rpc import security
from adapter_fabric.rpc.security import read_token
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store.manifest import manifest_request
from adapter_fabric.transport import fetch_metadata
from adapter_fabric.transport.data_channel import DataChannelFailed, DataChannels
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc


def refused(what: str, call) -> bool:
    try:
        call()
    except grpc.RpcError as exc:
        error = error_from_rpc(exc)
    except DataChannelFailed as exc:
        error = exc.error
    else:
        print(f"SERVED without a credential: {what}")
        return False
    ok = isinstance(error, Unauthenticated)
    print(f"{'refused' if ok else 'WRONG REFUSAL'} without a credential: {what}: {type(error).__name__}")
    return ok


def data_fetch(node: str, port: int, request: fabric_pb2.FetchRequest, token: str | None) -> int:
    channels = DataChannels(token=token)
    channels.learn(node, fetch_metadata.announce_data_port(port))
    call = channels.open(node, request, None, 1 << 20)
    if call is None:
        raise SystemExit(f"{node}: its data channel on port {port} could not be reached")
    return sum(len(view) for _, view in call)


def probe(node: str, adapter_id: str, token: str) -> bool:
    anonymous = fabric_pb2_grpc.FabricStub(security.channel(node))
    known = fabric_pb2_grpc.FabricStub(security.channel(node, token=token))
    manifest, call = known.GetManifest.with_call(manifest_request(adapter_id), timeout=30)
    port = fetch_metadata.data_port(call.initial_metadata())
    print(f"served with the token: GetManifest of {adapter_id} on {node} (data channel on port {port})")
    fetch = fabric_pb2.FetchRequest(adapter_id=adapter_id)
    by_digest = fabric_pb2.FetchRequest(digest=manifest.digest)
    checks = [
        refused(f"GetManifest on {node}", lambda: anonymous.GetManifest(manifest_request(adapter_id), timeout=30)),
        refused(f"Locate on {node}", lambda: anonymous.Locate(fabric_pb2.LocateRequest(adapter_id=adapter_id), timeout=30)),
        refused(f"Fetch on {node}", lambda: list(anonymous.Fetch(fetch, timeout=30))),
        refused(f"Fetch by digest on {node}", lambda: list(anonymous.Fetch(by_digest, timeout=30))),
        refused(f"Availability on {node}", lambda: anonymous.Availability(fabric_pb2.AvailabilityRequest(digest=manifest.digest), timeout=30)),
    ]
    if port is None:
        print(f"NO DATA CHANNEL announced by {node}")
        return False
    checks.append(refused(f"the data channel on {node}", lambda: data_fetch(node, port, by_digest, None)))
    moved = data_fetch(node, port, by_digest, token)
    print(f"served with the token: {moved} bytes over the data channel of {node}")
    return all(checks) and moved > 0


def main() -> None:
    adapter_id, token_file, *nodes = sys.argv[1:]
    token = read_token(token_file)
    results = [probe(node, adapter_id, token) for node in nodes]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
