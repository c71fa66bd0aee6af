"""The StoreStatus RPC: usage, quota, and the uploads and partial downloads the store keeps."""

from __future__ import annotations

from adapter_fabric.store import AdapterStore
from adapter_fabric.store.hygiene import UPLOAD, leftovers
from adapter_fabric.v1 import fabric_pb2
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.eviction import EvictWhenFull


class StoreReport:
    """The StoreStatus RPC: what the store holds, what it keeps aside, and when abandoned entries expire."""

    def __init__(self, context: NodeContext, expire_after: float, evictor: EvictWhenFull | None = None) -> None:
        self.context = context
        #: the evicting policy, when this node evicts at its limit (its count is reported)
        self.evictor = evictor
        self.store: AdapterStore = context.store
        #: --expire-abandoned-after in seconds (0 = never), reported to the caller
        self.expire_after = expire_after

    async def report(self) -> fabric_pb2.StoreStatusResponse:
        """Usage, quota, damaged entries, and the uploads and partials left in the store (read off the event loop)."""
        return await self.context.io(self._collect)

    def _collect(self) -> fabric_pb2.StoreStatusResponse:
        reply = fabric_pb2.StoreStatusResponse(
            used_bytes=self.store.usage(),
            quota_bytes=self.store.max_bytes or 0,
            adapters=len(self.store.list()),
            expire_after_seconds=self.expire_after,
            evictions=self.evictor.evictions if self.evictor is not None else 0,
            kept=self.store.kept.count(),
            evicts=self.evictor is not None,
        )
        for damaged in self.store.damaged():  # ids listed apart from adapters: adapter_fabric.store.integrity
            reply.damaged.append(fabric_pb2.DamagedEntry(adapter_id=damaged.adapter_id, digest=damaged.digest, reason=damaged.problem))
        for item in leftovers(self.store):
            entry = fabric_pb2.StoreLeftover(
                adapter_id=item.adapter_id, digest=item.digest, bytes=item.bytes, age_seconds=item.age_seconds, in_use=item.in_use
            )
            (reply.uploads if item.kind == UPLOAD else reply.partials).append(entry)
        return reply
