"""The StoreStatus RPC: usage, quota, and the uploads and partial downloads the store keeps (a mixin of the servicer)."""

from __future__ import annotations

from fabric.rpc.status import rpc_errors
from fabric.store.hygiene import UPLOAD, leftovers
from fabric.v1 import fabric_pb2


class StoreStatusRpc:
    """Mixed into ``FabricServicer`` (needs ``store``, ``_io``); ``expire_after`` is --expire-abandoned-after in seconds."""

    expire_after: float = 0.0

    @rpc_errors
    async def StoreStatus(self, request, context) -> fabric_pb2.StoreStatusResponse:
        def collect() -> fabric_pb2.StoreStatusResponse:
            reply = fabric_pb2.StoreStatusResponse(
                used_bytes=self.store.usage(),
                quota_bytes=self.store.max_bytes or 0,
                adapters=len(self.store.list()),
                expire_after_seconds=self.expire_after,
            )
            for damaged in self.store.damaged():  # ids listed apart from adapters: fabric.store.integrity
                reply.damaged.append(fabric_pb2.DamagedEntry(adapter_id=damaged.adapter_id, digest=damaged.digest, reason=damaged.problem))
            for item in leftovers(self.store):
                entry = fabric_pb2.StoreLeftover(
                    adapter_id=item.adapter_id, digest=item.digest, bytes=item.bytes, age_seconds=item.age_seconds, in_use=item.in_use
                )
                (reply.uploads if item.kind == UPLOAD else reply.partials).append(entry)
            return reply

        return await self._io(collect)
