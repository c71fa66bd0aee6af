"""The calls a puller makes to its peers: GetManifest, Availability and Fetch, each with its time limit.

Shared by the pull (``adapter_fabric.transport.pull``: the manifest, what a peer holds
for Locate) and the swarm download (``adapter_fabric.transport.swarm_fetch``: polls and
Fetch streams). Each turns a peer's gRPC answer into this library's values and
errors, so neither caller handles a status code of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import grpc

from adapter_fabric.errors import AdapterNotFound, IntegrityError, PeerUnavailable
from adapter_fabric.observability.metrics import FETCH_STREAMS
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import Manifest, manifest_request
from adapter_fabric.transport import fetch_metadata, swarm, wire
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataCall
from adapter_fabric.trust.signing import Signed, signatures_from_proto
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

__all__ = ["AVAILABILITY_TIMEOUT_S", "MANIFEST_TIMEOUT_S", "Holding", "HoldingCall", "fetch", "first_manifest", "holding", "is_durable"]

#: seconds for a manifest call; a dead peer answers UNAVAILABLE long before this
MANIFEST_TIMEOUT_S = 10.0
#: seconds for an Availability call
AVAILABILITY_TIMEOUT_S = 5.0
#: the generated stub's path for Availability (``fabric_pb2_grpc.FabricStub``)
AVAILABILITY_METHOD = "/fabric.v1.Fabric/Availability"
# Fetch has no deadline on purpose: one would cut slow, healthy peers. The swarm
# download's stall watchdog cancels a stream that delivers nothing instead
# (``PullSettings.stall_timeout``).


class Holding(NamedTuple):
    """What a peer holds of one digest: its verified chunks, whether it has them all, and the chunk count it announces."""

    chunks: set[int]
    complete: bool
    chunk_count: int


#: ``(peer, digest) -> Holding``; raises PeerUnavailable (or another FabricError) when the peer cannot answer
HoldingCall = Callable[[str, str], Holding]


def first_manifest(channels: PeerChannels, peers: Sequence[str], adapter_id: str) -> tuple[Manifest, str, tuple[Signed, ...]]:
    """The manifest from the first of ``peers`` that has it, that peer's address, and the signatures it carries (unverified)."""
    validate_adapter_id(adapter_id)
    if not peers:
        raise PeerUnavailable(f"no peer to pull {adapter_id!r} from: give a peer address")
    missing: list[str] = []
    failures: list[str] = []
    for peer in dict.fromkeys(peers):  # each peer asked (and named in an error) once
        stub = fabric_pb2_grpc.FabricStub(channels.get(peer))
        try:
            reply, call = stub.GetManifest.with_call(manifest_request(adapter_id), timeout=MANIFEST_TIMEOUT_S)
        except grpc.RpcError as exc:
            channels.failed(peer, exc)
            error = error_from_rpc(exc, peer=peer)
            if isinstance(error, AdapterNotFound):
                missing.append(peer)
            else:
                failures.append(f"{peer}: {error}")
            continue
        channels.learn(peer, call.initial_metadata())  # its data channel, if it offers one
        manifest = Manifest.from_proto(reply)  # self-consistent, and of this digest scheme (else IncompatibleFormat)
        if manifest.adapter_id != adapter_id:
            raise IntegrityError(f"peer {peer} answered for {manifest.adapter_id!r} when asked for {adapter_id!r}")
        return manifest, peer, signatures_from_proto(reply)
    if missing and not failures:
        raise AdapterNotFound(f"adapter {adapter_id!r} is not staged on {', '.join(missing)}: stage it there first, or name a peer that has it")
    raise PeerUnavailable(f"no peer could serve the manifest of {adapter_id!r}: " + "; ".join(failures + [f"{p}: not staged" for p in missing]))


def availability_call(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """Availability's callable alone: a swarm polls many times a second, and a ``FabricStub`` makes a callable for each
    of the service's RPCs (3% of a swarm node's Python time, py-spy, issue 34)."""
    return channel.unary_unary(
        AVAILABILITY_METHOD, request_serializer=fabric_pb2.AvailabilityRequest.SerializeToString,
        response_deserializer=fabric_pb2.AvailabilityResponse.FromString, _registered_method=True,
    )


def holding(channels: PeerChannels, peer: str, digest: str, timeout: float = AVAILABILITY_TIMEOUT_S) -> Holding:
    """What ``peer`` holds of ``digest`` (Availability, within ``timeout`` seconds); nothing held = ``Holding(set(), False, 0)``.

    Raises PeerUnavailable (or another FabricError) when the peer cannot answer.
    """
    try:
        reply, call = availability_call(channels.get(peer)).with_call(fabric_pb2.AvailabilityRequest(digest=digest), timeout=timeout)
    except grpc.RpcError as exc:
        channels.failed(peer, exc)
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return Holding(set(), False, 0)  # an older peer: it can still serve what GetManifest says it has
        error = error_from_rpc(exc, peer=peer)
        if isinstance(error, AdapterNotFound):
            return Holding(set(), False, 0)
        raise error from None
    channels.learn(peer, call.initial_metadata())
    if reply.complete:
        return Holding(set(range(reply.chunk_count)), True, reply.chunk_count)
    return Holding(swarm.bitmap_to_chunks(reply.verified_bitmap, reply.chunk_count), False, reply.chunk_count)


def is_durable(channels: PeerChannels, peer: str, timeout: float = AVAILABILITY_TIMEOUT_S) -> bool:
    """Whether ``peer`` says it is durable (never evicts): an Availability that names no digest.

    False for a peer that is not, that predates the field, or that does not answer.
    """
    stub = fabric_pb2_grpc.FabricStub(channels.get(peer))
    try:
        return stub.Availability(fabric_pb2.AvailabilityRequest(), timeout=timeout).durable
    except grpc.RpcError as exc:
        channels.failed(peer, exc)
        return False


def fetch(
    channels: PeerChannels, peer: str, request: fabric_pb2.FetchRequest, holder: tuple[int, bytes] | None, chunk_size: int,
    beside: bool = False,
) -> wire.FetchCall | DataCall:
    """Start a Fetch stream of ``request`` from ``peer``: a call that yields ``(offset, data)`` and can be cancelled from any thread.

    Over the peer's data channel when it announced one that answers, else over
    gRPC (also when the channel refuses the stream as busy or breaks before its first frame). No deadline (see above). ``holder`` is ``(port, verified bitmap)`` of
    this node when it serves what it pulls (``fetch_metadata.holder``). ``beside``: one of several streams of ours to ``peer``
    at once; refused as busy by an older node, which names no bound, it ends so (``FetchBusy``) rather than going to gRPC,
    which the same per-peer limit would refuse (``DataCall``: a newer node's named bound decides).
    """
    metadata = fetch_metadata.holder(*holder) if holder is not None else ()

    def over_grpc() -> wire.FetchCall:
        FETCH_STREAMS.labels("grpc").inc()
        return wire.fetch_stub(channels.get(peer))(request, metadata=metadata)

    if channels.data is not None:
        # refused busy, or broken before a frame: gRPC
        call = channels.data.open(peer, request, holder, chunk_size, fallback=over_grpc, behalf=channels.behalf)
        if call is not None:
            FETCH_STREAMS.labels("data").inc()
            call.grpc_when_busy = not beside
            return call
    return over_grpc()
