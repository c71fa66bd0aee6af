"""Limits a node enforces on what callers may make it do, and their defaults.

Size limits (adapter bytes, header bytes, store bytes) live in ``AdapterStore``,
which checks them before a byte is written, for client uploads and peer pulls
alike. This module holds the defaults and the one limit that is about
connections rather than bytes: concurrent ``Fetch`` streams per peer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc

from adapter_fabric.errors import PEER_STREAMS_BOUND, PeerUnavailable, QuotaExceeded
from adapter_fabric.rpc.status import abort_with

#: largest adapter (weights file) a node accepts by default: well above any LoRA of a 70B model at rank 64
DEFAULT_MAX_ADAPTER_BYTES = 4 << 30
#: largest safetensors header by default: a LoRA header is a few hundred bytes per tensor
DEFAULT_MAX_HEADER_BYTES = 8 << 20
#: concurrent Fetch streams one peer host may hold open (a swarm pull opens a few; a loop opening thousands is refused)
DEFAULT_MAX_STREAMS_PER_PEER = 64

FETCH_METHOD = "/fabric.v1.Fabric/Fetch"


def peer_host(peer: str) -> str:
    """The host part of a grpc peer string: ``ipv4:10.0.0.2:5123`` -> ``10.0.0.2``, ``ipv6:[::1]:5123`` -> ``[::1]``.

    Streams are counted per host, not per connection: a peer that opens many
    channels (one per port) is still one peer.
    """
    _, _, address = peer.partition(":")
    if not address:
        return peer
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address


class PeerStreamLimit(grpc.aio.ServerInterceptor):
    """At most ``limit`` concurrent Fetch streams per peer host; the next gets RESOURCE_EXHAUSTED (retryable)."""

    def __init__(self, limit: int, method: str = FETCH_METHOD) -> None:
        if limit <= 0:
            raise ValueError(f"max streams per peer must be positive, got {limit}")
        self.limit = limit
        self.method = method
        self.open: dict[str, int] = {}  # the event loop is the only thread that touches it
        self.closed = ""  # once the node drains: why no new stream is taken
        self.last_ended: float | None = None  # time.monotonic() when a stream last ended (None: none has)
        self.unheard: set[str] = set()  # once closed: hosts that were reading then and have not been refused since

    def close(self, cause: str) -> None:
        """No new stream of any peer from now on (``PeerUnavailable(cause)``); open ones go on."""
        self.closed = cause
        self.unheard = set(self.open)

    @property
    def streams_open(self) -> int:
        return sum(self.open.values())

    def enter(self, host: str) -> None:
        """Count one more stream of ``host`` (gRPC Fetch and the data channel alike); QuotaExceeded when it holds ``limit``."""
        if self.closed:
            self.unheard.discard(host)  # it has heard why
            raise PeerUnavailable(self.closed)
        if self.open.get(host, 0) >= self.limit:
            raise QuotaExceeded(f"peer {host} already holds {self.limit} Fetch streams to this node (--max-streams-per-peer); finish one first", PEER_STREAMS_BOUND)
        self.open[host] = self.open.get(host, 0) + 1

    def leave(self, host: str) -> None:
        """One stream of ``host`` ended."""
        left = self.open[host] - 1
        self.last_ended = time.monotonic()
        if left:
            self.open[host] = left
        else:
            del self.open[host]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method != self.method or handler.unary_stream is None:
            return handler
        behavior = handler.unary_stream

        async def counted(request, context):
            host = peer_host(context.peer())
            try:
                self.enter(host)
            except (QuotaExceeded, PeerUnavailable) as exc:
                await abort_with(context, exc)
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                self.leave(host)

        return grpc.unary_stream_rpc_method_handler(
            counted, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
