"""The model-side RPCs: ListAdapters (the store and the slot pool), SetActive, Pin, and Generate."""

from __future__ import annotations

import grpc

from adapter_fabric.access.caller import caller
from adapter_fabric.errors import DeadlineExceeded, InvalidArgument
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.origin_fetch import OriginFetches
from adapter_fabric.origins.records import RevisionRecord
from adapter_fabric.serving.names import ACTIVE
from adapter_fabric.store.catalog import Listed, is_digest
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.v1 import fabric_pb2

#: the name a GenerateRequest uses for the base model
BASE_NAME = "base"
#: staged adapters in one ListAdapters page when the caller names no size, and the most it may ask for (a few hundred bytes an adapter)
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 5000


def _staged(entry: Listed, engines: list[str], record: RevisionRecord | None = None) -> fabric_pb2.StagedAdapter:
    """A listed id on the wire; a damaged one carries its problem (adapter_fabric.store.integrity) instead of failing the list."""
    s = entry.summary
    if s is None:
        return fabric_pb2.StagedAdapter(
            adapter_id=entry.adapter_id, digest=entry.digest if is_digest(entry.digest) else "", damaged=entry.problem, engines=engines,
        )
    staged = fabric_pb2.StagedAdapter(
        adapter_id=entry.adapter_id, digest=entry.digest, content_id=s.content_id, size=s.total_size, damaged=entry.problem, engines=engines,
        origin=record.revision.origin if record is not None else None,
        revision=record.revision.revision if record is not None else None,
        checked_at=record.checked_at if record is not None else None,
    )
    staged.peft.MergeFromString(s.peft)  # serialized once per config (adapter_fabric.store.summaries)
    return staged


class Slots:
    """ListAdapters, SetActive, Pin and Generate: what is staged and resident, and the work on resident adapters."""

    def __init__(
        self, context: NodeContext, max_new_tokens: int, engines: EngineViews | None = None, origins: OriginFetches | None = None
    ) -> None:
        """``origins``: each listed id's origin and revision, when it came from one."""
        self.context = context
        self.origins = origins
        #: which engines registered each adapter (--engine-url), shown per listed adapter
        self.engines = engines
        self.store = context.store
        #: the most tokens one Generate may ask for (--max-new-tokens: each is a decode step on the model worker)
        self.max_new_tokens = max_new_tokens

    async def list_adapters(self, request: fabric_pb2.ListAdaptersRequest) -> fabric_pb2.ListAdaptersResponse:
        """One page of the staged adapters, sorted by id (damaged ones with their problem), and, with a model, every slot."""
        after = request.page_token
        if after:
            try:
                validate_adapter_id(after)
            except InvalidArgument:
                raise InvalidArgument(f"page_token {after[:100]!r} is not one this node answered; start again from an empty token") from None
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        # Only what the caller may read, chosen before the page is cut: no foreign id, and no count of them.
        who = caller()
        readable = None if who.may_everywhere("read") else who.matcher("read")  # over the index's ids, all valid
        listed = await self.context.io(self.store.page, after, size + 1, readable)  # one more: is there a next page?
        engines_of = self.engines.engines_of if self.engines is not None else (lambda _: [])
        origins = self.origins
        records: dict[str, RevisionRecord | None] = {}
        if origins is not None and origins.origins:  # each id's revision record: one small read, off the event loop
            records = await self.context.io(lambda: {e.adapter_id: origins.record_of(e.adapter_id, e.digest) for e in listed[:size]})
        staged = [_staged(entry, engines_of(entry.adapter_id), records.get(entry.adapter_id)) for entry in listed[:size]]
        reply = fabric_pb2.ListAdaptersResponse(staged=staged, next_page_token=staged[-1].adapter_id if len(listed) > size else "")
        model = self.context.model
        if model is not None:
            reply.max_rank = model.pool.max_rank
            reply.device = str(model.device)
            for info in model.slots_info():
                if readable is not None and info.name and not who.allows("read", info.name):  # a name need not be a valid id
                    continue  # another principal's resident adapter
                reply.slots.append(
                    fabric_pb2.SlotInfo(
                        slot=info.slot,
                        name=info.name or "",
                        content_id=info.content_id,
                        ref_count=info.ref_count,
                        pinned=info.pinned,
                        active=info.active,
                        last_used=info.last_used,
                        rank=info.rank,
                        digest=info.digest,  # the bytes it holds, also once they are unstaged from the store
                    )
                )
        return reply

    async def set_active(self, request: fabric_pb2.SetActiveRequest) -> fabric_pb2.SetActiveResponse:
        """Make a resident adapter the active one (the one slot -1 means)."""
        model = self.context.require_model("set an active adapter")
        await self.context.on_model(model.set_active_lora, request.name)
        slot = model.pool.active_slot
        return fabric_pb2.SetActiveResponse(slot=slot, content_id=model.adapter_id_for(slot) if slot is not None else 0)

    async def pin(self, request: fabric_pb2.PinRequest) -> fabric_pb2.PinResponse:
        """Pin (or unpin) a resident adapter: a pinned slot is never a victim."""
        model = self.context.require_model("pin adapters")
        await self.context.on_model(model.pin, request.name, request.pinned)
        return fabric_pb2.PinResponse(slot=model.pool.slot_of(request.name))

    async def generate(self, request: fabric_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.GenerateResponse:
        """Decode with the base model, the active adapter or a resident one, one model-worker job per step."""
        model = self.context.require_model("generate")
        # None = base model, -1 = the active adapter (base when none is active), else a resident name.
        from adapter_fabric.serving.generation import Generation  # torch: only a node with a model gets here

        target = None if request.use_base or request.adapter == BASE_NAME else (request.adapter or ACTIVE)
        run = Generation(model, request.input_ids, target, request.max_new_tokens, request.return_logits, self.max_new_tokens)
        finished = False
        try:
            # One job per step (adapter_fabric.serving.generation): promotes land between steps, and a caller
            # that cancels or passes its deadline (this coroutine is cancelled) stops the steps.
            await self.context.on_model(run.start)
            while not run.done:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    # Never an OK with fewer tokens than asked: the server's clock may pass the deadline
                    # a moment before the caller's, which would then take a cut generation for a whole one.
                    raise DeadlineExceeded(
                        f"the deadline passed after {len(run.output_ids)} of {request.max_new_tokens} new tokens; ask for fewer, or allow more time"
                    )
                await self.context.on_model(run.step)
            # The ref is dropped before the reply: a caller that goes on (a listing, a promote that would evict the slot) never
            # finds it held by a generation that has answered.
            await self.context.on_model(run.finish)
            finished = True
            return fabric_pb2.GenerateResponse(slot=run.resolved, content_id=run.content_id, last_logits=run.last_logits, output_ids=run.output_ids)
        finally:
            if not finished:  # refused or cancelled: after any job still queued or running, so never before the ref was taken
                self.context.after_model_jobs(run.finish)
