"""StageMany: many small adapters published on one stream, committed in groups.

Each request is one whole adapter (a StageBegin, every byte of its weights, the
digest it declares). A reader task takes requests as they arrive, holding at
most ``MAX_STREAM_BYTES`` of them uncommitted (past that it stops reading: gRPC's
flow control holds the client). The stream's loop takes what has arrived, up to
``BATCH_ADAPTERS`` or ``BATCH_BYTES``, and hands it to one I/O thread: each
adapter is checked as Stage checks it (``Staging.accept``, ``Staging.open``,
``Upload.append``, the caller's ``publish`` on its id), then the batch is
committed as one group (``commit_uploads``: one journal flush and one sync per
directory). A result per adapter goes back once its commit is durable, or its
refusal by name; the others go on. One log line per batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from adapter_fabric.access.caller import caller
from adapter_fabric.access.policy import Principal, canonical_id
from adapter_fabric.errors import Busy, FabricError, IntegrityError, InvalidArgument
from adapter_fabric.node.staging import Accepted, Staging
from adapter_fabric.observability.audit import audit
from adapter_fabric.observability.logs import event
from adapter_fabric.observability.metrics import ACCESS_REFUSALS, STAGE_BYTES, STAGES
from adapter_fabric.rpc.status import public_message
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.upload import Upload, commit_uploads
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.node")

#: adapters one StageMany stream takes: a larger publish is the client's next stream
MAX_ADAPTERS_PER_CALL = 100_000
#: the largest weights file one request carries (the client's upload piece): a larger adapter goes by Stage, resumable
MAX_ADAPTER_BYTES = 1 << 20
#: adapters and bytes committed as one group (the committer's batch: ``adapter_fabric.store.committer.MAX_BATCH``)
BATCH_ADAPTERS = 256
BATCH_BYTES = 16 << 20
#: bytes one stream holds received but not yet committed; past it the stream stops reading
MAX_STREAM_BYTES = 32 << 20
#: StageMany streams a node runs at once; another is refused ``Busy`` (so at most 4 x 32 MiB held in all)
MAX_STREAMS = 4


@dataclass
class _Item:
    """One adapter of a batch, as it goes: its request, then its upload and acceptance, or its refusal."""

    request: fabric_pb2.StageManyRequest
    accepted: Accepted | None = None
    upload: Upload | None = None
    outcome: Manifest | BaseException | None = None
    reply: fabric_pb2.StageResponse | None = None  # set once it committed and its reply is made

    @property
    def adapter_id(self) -> str:
        return self.request.begin.adapter_id

    @property
    def size(self) -> int:
        return len(self.request.data) + len(self.request.begin.config_json)


class _Held:
    """The bytes a stream holds uncommitted: the reader waits while they are past the bound."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.bytes = 0
        self._room = asyncio.Condition()

    async def take(self, size: int) -> None:
        async with self._room:
            await self._room.wait_for(lambda: self.bytes == 0 or self.bytes + size <= self.bound)
            self.bytes += size

    async def give(self, size: int) -> None:
        async with self._room:
            self.bytes -= size
            self._room.notify_all()


_END = object()  # the reader's last word: the client closed its side


class StageMany:
    """The StageMany RPC of one node (``Staging`` does each adapter's checks, as for Stage)."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self._streams = 0

    async def stage_many(self, requests: AsyncIterator[fabric_pb2.StageManyRequest]) -> AsyncIterator[fabric_pb2.StageManyResult]:
        """Commit the stream's adapters in groups; a result for each, in the order they came, as its group commits."""
        if self._streams >= MAX_STREAMS:
            raise Busy(f"StageMany: this node runs {self._streams} StageMany streams, the most it takes at once ({MAX_STREAMS}); retry when one ends")
        self._streams += 1
        who = caller()
        held = _Held(MAX_STREAM_BYTES)
        arrived: asyncio.Queue[_Item | BaseException | object] = asyncio.Queue()
        reader = asyncio.create_task(self._read(requests, arrived, held))
        try:
            while True:
                batch, end = await self._next_batch(arrived)
                if batch:
                    started = time.monotonic()
                    await self.staging.context.io(self._commit, batch, who)
                    await held.give(sum(item.size for item in batch))
                    self._told(batch, who, time.monotonic() - started)
                    for item in batch:
                        yield self._result(item)
                if isinstance(end, BaseException):
                    raise end
                if end is _END:
                    return
        finally:
            reader.cancel()
            self._streams -= 1

    async def _read(self, requests: AsyncIterator[fabric_pb2.StageManyRequest], arrived: asyncio.Queue, held: _Held) -> None:
        """Every request into ``arrived`` (bounded by ``held``), then ``_END``; a broken or oversized stream: its error."""
        count = 0
        try:
            async for request in requests:
                count += 1
                if count > MAX_ADAPTERS_PER_CALL:
                    raise InvalidArgument(f"StageMany sent more than {MAX_ADAPTERS_PER_CALL} adapters on one stream; send the rest on another")
                item = _Item(request)
                await held.take(item.size)
                arrived.put_nowait(item)
            arrived.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (handed to the stream's loop, which raises it after the batch before it)
            arrived.put_nowait(exc)

    @staticmethod
    async def _next_batch(arrived: asyncio.Queue) -> tuple[list[_Item], object | None]:
        """What has arrived (at least one request, or the end), up to a batch's bounds; and the end, if it came."""
        batch: list[_Item] = []
        size = 0
        first = await arrived.get()
        while True:
            if not isinstance(first, _Item):
                return batch, first
            batch.append(first)
            size += first.size
            if len(batch) >= BATCH_ADAPTERS or size >= BATCH_BYTES or arrived.empty():
                return batch, None
            first = arrived.get_nowait()

    def _commit(self, batch: list[_Item], who: Principal) -> None:
        """Check and write each adapter of ``batch``, then commit the ones that passed as one group. Blocking."""
        try:
            for item in batch:
                try:
                    self._open(item, who)
                except FabricError as exc:
                    item.outcome = exc
            opened = [(item, item.upload) for item in batch if item.upload is not None and item.outcome is None]
            for (item, _), outcome in zip(opened, commit_uploads([upload for _, upload in opened]), strict=True):
                item.outcome = outcome
                if isinstance(outcome, Manifest) and item.upload is not None and item.accepted is not None:
                    try:
                        item.reply = self.staging.staged(item.upload, outcome, item.accepted, who, len(item.request.data))
                    except FabricError as exc:  # committed, but its signature could not be kept: as Stage, the caller hears it
                        item.outcome = exc
        finally:
            for item in batch:
                if item.upload is not None and item.reply is None:
                    item.upload.discard()  # not resumable: its bytes come again whole (nothing once it committed)

    def _open(self, item: _Item, who: Principal) -> None:
        """Stage's checks of one adapter, and its bytes written to its upload (not yet committed)."""
        request, begin = item.request, item.request.begin
        if begin.offset:
            raise InvalidArgument(f"StageMany of {begin.adapter_id[:200]!r}: StageBegin.offset is {begin.offset}; an adapter comes whole, from 0")
        if len(request.data) > MAX_ADAPTER_BYTES:
            raise InvalidArgument(
                f"StageMany of {begin.adapter_id[:200]!r}: {len(request.data)} bytes of weights, more than one request carries ({MAX_ADAPTER_BYTES}); "
                f"stage it with Stage"
            )
        if len(request.data) != begin.safetensors_size:
            raise InvalidArgument(
                f"StageMany of {begin.adapter_id[:200]!r}: {len(request.data)} bytes of weights sent, {begin.safetensors_size} declared"
            )
        canonical_id(begin.adapter_id)  # a malformed id is refused as such, whoever asks (as the gate does for Stage)
        try:
            who.check("publish", begin.adapter_id)
        except FabricError as exc:
            ACCESS_REFUSALS.labels("publish").inc()
            audit("stage", who.name, "refused", adapter_id=begin.adapter_id, detail=str(exc))
            raise
        item.accepted = self.staging.accept(begin, who)
        if request.digest != item.accepted.digest:
            raise IntegrityError(
                f"StageMany of {begin.adapter_id[:200]!r}: declared digest {request.digest[:64]!r}, but its config and declared weights root "
                f"give {item.accepted.digest} at this node's chunk size"
            )
        item.upload = self.staging.open(begin)
        item.upload.append(0, request.data)

    @staticmethod
    def _result(item: _Item) -> fabric_pb2.StageManyResult:
        if item.reply is not None:
            STAGES.labels("ok").inc()
            STAGE_BYTES.inc(len(item.request.data))
            return fabric_pb2.StageManyResult(adapter_id=item.adapter_id, staged=item.reply)
        outcome = item.outcome
        error = outcome if isinstance(outcome, FabricError) else FabricError(f"StageMany of {item.adapter_id[:200]!r}: {outcome!r}")
        STAGES.labels(type(error).__name__).inc()
        detail = fabric_pb2.ErrorDetail(kind=type(error).__name__, message=public_message(error), retryable=error.retryable)
        return fabric_pb2.StageManyResult(adapter_id=item.adapter_id, error=detail)

    def _told(self, batch: list[_Item], who: Principal, seconds: float) -> None:
        """One log line for the batch (counts; the first refusal), one audit line per adapter committed (as a Stage has:
        an auditor looks an id up, not a batch), and the homes told of each commit."""
        committed = [item.reply for item in batch if item.reply is not None]
        refused = [item for item in batch if item.reply is None]
        event(
            log, "StageMany committed a batch", adapters=len(batch), committed=len(committed), refused=len(refused),
            first_refused=refused[0].adapter_id[:200] if refused else None, bytes=sum(item.size for item in batch), seconds=round(seconds, 4),
        )
        for reply in committed:
            audit("stage", who.name, "ok", adapter_id=reply.adapter_id, digest=reply.digest, detail=f"StageMany, a batch of {len(batch)}")
        if self.staging.on_staged is not None:
            for reply in committed:
                self.staging.on_staged(reply.adapter_id, reply.digest)  # queues background work only
