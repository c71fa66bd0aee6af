"""The StoreStatus RPC: usage, quota, and the uploads and partial downloads the store keeps."""

from __future__ import annotations

import time
from collections.abc import Callable

from adapter_fabric.access.caller import caller
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.eviction import Evictor
from adapter_fabric.node.origin_fetch import OriginFetches
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.hygiene import PARTIAL, UPLOAD
from adapter_fabric.v1 import fabric_pb2

#: uploads, partials and damaged entries listed in one reply, each (the reply counts them all)
MAX_LISTED = 100


class StoreReport:
    """The StoreStatus RPC: what the store holds, what it keeps aside, and when abandoned entries expire."""

    def __init__(self, context: NodeContext, expire_after: float, evictor: Evictor | None = None, origins: OriginFetches | None = None) -> None:
        #: the --origin list's states (answering or not, since when), reported per origin
        self.origins = origins
        self.context = context
        #: the evicting policy, when this node evicts at its limit (its count is reported)
        self.evictor = evictor
        self.store: AdapterStore = context.store
        #: --expire-abandoned-after in seconds (0 = never), reported to the caller
        self.expire_after = expire_after

    async def report(self) -> fabric_pb2.StoreStatusResponse:
        """Usage, quota, damaged entries, and the uploads and partials left in the store (read off the event loop).

        A caller that may not read every id (``--policy``) sees the ids it may read and their counts only, and the
        quota lines of the tenants whose every id it may read (a line is the usage of all of them); the node's own
        figures (bytes used, the limit, evictions) stay whole, as ``/metrics`` shows them.
        """
        who = caller()
        if who.may_everywhere("read"):
            return await self.context.io(self._collect, None, None)
        return await self.context.io(self._collect, who.matcher("read"), lambda prefix: who.holds_prefix("read", prefix))

    def _collect(self, readable: Callable[[str], bool] | None, tenant_shown: Callable[[str], bool] | None) -> fabric_pb2.StoreStatusResponse:
        shown = readable or (lambda adapter_id: True)
        sound, damaged = self.store.census()  # one pass over the ids: no manifest listing beside the damage check
        if readable is not None:
            sound = [i for i in sound if shown(i)]
            damaged = [d for d in damaged if shown(d.adapter_id)]
        reply = fabric_pb2.StoreStatusResponse(
            used_bytes=self.store.usage(),
            quota_bytes=self.store.max_bytes or 0,
            adapters=len(sound),
            expire_after_seconds=self.expire_after,
            evictions=self.evictor.evictions if self.evictor is not None else 0,
            kept=self.store.kept_count() if readable is None else sum(self.store.is_kept(i) for i in sound),
            evicts=self.evictor is not None,
            damaged_total=len(damaged),
        )
        now = time.time()
        for ids, digest, size, at, why in reversed(list(self.evictor.recent) if self.evictor is not None else []):  # newest first
            shown_ids = [i for i in ids if shown(i)]
            if shown_ids or readable is None:
                reason = why[:300] if readable is None else ""  # the commit it made room for may be another tenant's id
                reply.recent_evictions.append(
                    fabric_pb2.Eviction(adapter_ids=shown_ids[:16], digest=digest, bytes=size, age_seconds=max(0.0, now - at), reason=reason)
                )
        for tenant in self.store.tenant_usage():  # one per quota: bounded by the policy's MAX_QUOTAS
            if tenant_shown is not None and not tenant_shown(tenant.prefix):
                continue  # another tenant's ids and bytes, which move as it stages
            reply.tenants.append(
                fabric_pb2.TenantUsage(
                    prefix=tenant.prefix, max_bytes=tenant.max_bytes or 0, max_adapters=tenant.max_adapters or 0,
                    bytes=tenant.bytes, adapters=tenant.adapters,
                )
            )
        origins = self.origins
        for state in origins.states.values() if origins is not None else ():  # one per --origin (at most 16)
            reply.origins.append(fabric_pb2.OriginState(origin=state.label, answering=state.answering, error=state.error, since=state.since))
        for entry in damaged[:MAX_LISTED]:  # ids listed apart from adapters: adapter_fabric.store.integrity
            reply.damaged.append(fabric_pb2.DamagedEntry(adapter_id=entry.adapter_id, digest=entry.digest, reason=entry.problem))
        kept_aside = [item for item in self.store.leftovers() if shown(item.adapter_id)]
        uploads = [item for item in kept_aside if item.kind == UPLOAD]
        partials = [item for item in kept_aside if item.kind == PARTIAL]
        reply.uploads_total, reply.partials_total = len(uploads), len(partials)
        for items, listed in ((uploads, reply.uploads), (partials, reply.partials)):
            for item in items[:MAX_LISTED]:  # oldest first: the ones an operator would clear
                listed.append(
                    fabric_pb2.StoreLeftover(
                        adapter_id=item.adapter_id, digest=item.digest, bytes=item.bytes, age_seconds=item.age_seconds, in_use=item.in_use
                    )
                )
        return reply
