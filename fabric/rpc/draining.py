"""A node going down refuses new calls by name while the calls it is serving finish.

grpc's own ``server.stop`` refuses new calls at once, and the caller sees only
"connection refused": a receiver whose next Fetch of a draining seed fails that
way cannot tell a peer that is stopping from a wrong address. Once this gate is
closed the server still listens, and every new Fabric call is refused with
UNAVAILABLE naming the cause; health and reflection pass (health already says
NOT_SERVING). The node stops the server once its Fetch streams have ended, or
the drain bound is near.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.rpc.status import FABRIC_PREFIX, refusing_handler


class DrainGate(grpc.aio.ServerInterceptor):
    """Open until ``close(cause)``; then every new Fabric call is refused with ``PeerUnavailable(cause)``."""

    def __init__(self) -> None:
        self.cause = ""

    def close(self, cause: str) -> None:
        self.cause = cause

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.cause or not details.method.startswith(FABRIC_PREFIX):
            return handler
        return refusing_handler(handler, PeerUnavailable(self.cause))
