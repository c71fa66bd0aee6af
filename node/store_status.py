"""The StoreStatus RPC: usage, quota, and the uploads and partial downloads the store keeps."""

from __future__ import annotations

from typing import Callable

from adapter_fabric.access.caller import caller
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
        """Usage, quota, damaged entries, and the uploads and partials left in the store (read off the event loop).

        A caller that may not read every id (``--policy``) sees the ids it may read and their counts only; the
        node's own figures (bytes used, the limit, evictions) stay whole, as ``/metrics`` shows them.
        """
        who = caller()
        readable = None if who.may_everywhere("read") else (lambda adapter_id: who.allows("read", adapter_id))
        return await self.context.io(self._collect, readable)

    def _collect(self, readable: Callable[[str], bool] | None) -> fabric_pb2.StoreStatusResponse:
        shown = readable or (lambda adapter_id: True)
        ids = [m.adapter_id for m in self.store.list()]
        reply = fabric_pb2.StoreStatusResponse(
            used_bytes=self.store.usage(),
            quota_bytes=self.store.max_bytes or 0,
            adapters=len(ids) if readable is None else sum(1 for i in ids if shown(i)),
            expire_after_seconds=self.expire_after,
            evictions=self.evictor.evictions if self.evictor is not None else 0,
            kept=self.store.kept.count() if readable is None else sum(1 for i in ids if shown(i) and i in self.store.kept),
            evicts=self.evictor is not None,
        )
        for tenant in self.store.tenant_usage():  # one per quota: bounded by the policy's MAX_QUOTAS
            reply.tenants.append(
                fabric_pb2.TenantUsage(
                    prefix=tenant.prefix, max_bytes=tenant.max_bytes or 0, max_adapters=tenant.max_adapters or 0,
                    bytes=tenant.bytes, adapters=tenant.adapters,
                )
            )
        for damaged in self.store.damaged():  # ids listed apart from adapters: adapter_fabric.store.integrity
            if shown(damaged.adapter_id):
                reply.damaged.append(fabric_pb2.DamagedEntry(adapter_id=damaged.adapter_id, digest=damaged.digest, reason=damaged.problem))
        for item in leftovers(self.store):
            if not shown(item.adapter_id):
                continue
            entry = fabric_pb2.StoreLeftover(
                adapter_id=item.adapter_id, digest=item.digest, bytes=item.bytes, age_seconds=item.age_seconds, in_use=item.in_use
            )
            (reply.uploads if item.kind == UPLOAD else reply.partials).append(entry)
        return reply
