"""What the node records about its own work: one log line and the metrics of every RPC, pull and promote.

``RpcObserver`` is the outermost server interceptor, so it sees every Fabric
call but the Fetch stream as the caller does, refusals by the auth interceptor included; the
servicer stays free of bookkeeping. ``ObservedPuller`` does the same for
pulls (a Promote from a peer, or a stage-only pull). ``refresh_gauges`` sets
the state gauges from the pool and the store right before a scrape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc

from adapter_fabric import errors
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.rpc.bounds import shown
from adapter_fabric.rpc.status import ERROR_DETAIL_KEY, FABRIC_PREFIX, bounded
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.pull import PeerPuller, PullStats
from adapter_fabric.v1 import fabric_pb2

if TYPE_CHECKING:  # the model module loads torch
    from adapter_fabric.serving.multi_lora import MultiLoraModel

log = logging.getLogger("fabric.rpc")
pull_log = logging.getLogger("fabric.pull")



def outcome_of(exc: BaseException | None) -> str:
    """``ok``, an error type of adapter_fabric.errors, or ``internal``: a bounded label."""
    if exc is None:
        return metrics.OK
    name = type(exc).__name__
    return name if isinstance(exc, errors.FabricError) and getattr(errors, name, None) is type(exc) else "internal"


def _error_detail(context: grpc.aio.ServicerContext) -> tuple[str | None, str | None]:
    """``(type, message)`` of the error the servicer sent in its trailer (adapter_fabric.rpc.status); Nones if none."""
    try:
        trailing = context.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 (older grpc: no getter)
        return None, None
    for key, value in trailing:
        if key == ERROR_DETAIL_KEY:
            detail = fabric_pb2.ErrorDetail.FromString(value)
            return detail.kind, bounded(detail.message) or None
    return None, None


class _Call:
    """What one RPC did, filled in as it runs."""

    def __init__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.method = method
        self.context = context
        self.started = time.monotonic()
        # Read now: a finished or cancelled call's context must not be asked (grpc.aio can crash the process).
        self.peer = context.peer()
        self.adapter_id: str | None = None
        self.bytes = 0
        self.request: Any = None
        self.response: Any = None
        self.message: str | None = None  # a refusal's message (the one line that logs it)

    def note_request(self, request: Any) -> None:
        self.request = request
        named = getattr(request, "adapter_id", None) or getattr(request, "digest", None) or None
        self.adapter_id = shown(named) if named else None  # logged even when the servicer refuses an oversized one

    def note_response(self, response: Any) -> Any:
        """``response``, kept for the log line (a Promote's bytes and source peer)."""
        self.response = response
        return response

    async def counted(self, requests: AsyncIterator[fabric_pb2.StageRequest]) -> AsyncIterator[fabric_pb2.StageRequest]:
        """Stage's messages, passed through: the adapter id from its begin, the data bytes counted."""
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "begin":
                self.adapter_id = shown(message.begin.adapter_id)
            elif kind == "data":
                self.bytes += len(message.data.data)
            yield message

    def __enter__(self) -> _Call:
        return self

    def __exit__(self, kind: type[BaseException] | None, failure: BaseException | None, traceback: Any) -> None:
        """The call ended (``failure``: how, None when it answered): recorded once. The exception is not kept (no frame cycle)."""
        self.finish(failure)

    def finish(self, failure: BaseException | None) -> None:
        elapsed = time.monotonic() - self.started
        code, kind = self._status(failure)
        method = self.method
        metrics.RPC_SECONDS.labels(method).observe(elapsed)
        if code != "OK":
            metrics.RPC_ERRORS.labels(method, code).inc()
        outcome = metrics.OK if code == "OK" else (kind if kind and getattr(errors, kind, None) else code)
        verdict = "ok" if code == "OK" else "error"
        if method == "Promote" and not getattr(self.request, "stage_only", False):
            metrics.PROMOTES.labels(outcome).inc()
            metrics.PROMOTE_SECONDS.labels(verdict).observe(elapsed)
        elif method == "Generate":
            metrics.GENERATE_SECONDS.observe(elapsed)
        elif method == "Stage":
            metrics.STAGES.labels(outcome).inc()
            metrics.STAGE_BYTES.inc(self.bytes)
        if self.response is not None and hasattr(self.response, "bytes_transferred"):
            self.bytes = self.response.bytes_transferred
        level = logging.WARNING if code == "UNAUTHENTICATED" else logging.INFO
        # Never the metadata: it carries the bearer token.
        event(
            log, f"{method} {outcome}" + (f": {self.message}" if self.message else ""), level,
            method=method, adapter=self.adapter_id, peer=self.peer, bytes=self.bytes,
            duration_s=round(elapsed, 6), outcome=outcome, code=code, error=kind,
            source_peer=getattr(self.response, "source_peer", None) or None,
        )

    def _status(self, failure: BaseException | None) -> tuple[str, str | None]:
        """(gRPC code name, fabric error type or None) of how the call ended."""
        if failure is None:
            return "OK", None
        if isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED", None  # the caller went away (or a drain cut it): the context is gone
        kind, self.message = _error_detail(self.context)
        try:
            code = self.context.code()
        except Exception:  # noqa: BLE001 (older grpc: no getter)
            code = None
        if isinstance(code, grpc.StatusCode):
            return code.name, kind
        for known in grpc.StatusCode:
            if code is not None and known.value[0] == code:
                return known.name, kind
        return "UNKNOWN", kind or type(failure).__name__


class RpcObserver(grpc.aio.ServerInterceptor):
    """Times, counts and logs every Fabric RPC (health and reflection pass untouched)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(FABRIC_PREFIX) or (handler.response_streaming and not handler.request_streaming):
            # Fetch (the one response stream) passes untouched: another async-generator layer changes when a
            # cancelled stream's own cleanup runs, which super-seeding's hand-out counts depend on. Its bytes are
            # counted where they are sent (node.peer_reads).
            return handler
        return _wrap(handler, details.method[len(FABRIC_PREFIX):])


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` timed, counted and logged: a unary call, Stage (a request stream) or StageMany (both ways); never Fetch."""
    if handler.request_streaming and handler.response_streaming:
        bidi = handler.stream_stream

        async def stream_stream(request_iterator, context):
            with _Call(method, context):
                async with aclosing(bidi(request_iterator, context)) as results:
                    async for result in results:
                        yield result

        return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer, handler.response_serializer)
    if handler.request_streaming:
        behavior = handler.stream_unary

        async def stream_unary(request_iterator, context):
            with _Call(method, context) as call:
                return call.note_response(await behavior(call.counted(request_iterator), context))

        return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer, handler.response_serializer)
    behavior = handler.unary_unary

    async def unary_unary(request, context):
        with _Call(method, context) as call:
            call.note_request(request)
            return call.note_response(await behavior(request, context))

    return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer, handler.response_serializer)


class ObservedPuller(PeerPuller):
    """A ``PeerPuller`` that counts, times and logs each pull; ``known_peers`` bounds the peer label."""

    def __init__(self, *args, known_peers: Callable[[], Iterable[str]] = tuple, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.known_peers = known_peers

    def pull(self, peers: Sequence[str], adapter_id: str, check=None, sink_for=None, **authority) -> tuple[Any, PullStats]:
        started = time.monotonic()
        try:
            manifest, stats = super().pull(peers, adapter_id, check, sink_for, **authority)
        except BaseException as exc:
            elapsed = time.monotonic() - started
            metrics.PULLS.labels(outcome_of(exc)).inc()
            metrics.PULL_SECONDS.labels("error").observe(elapsed)
            event(pull_log, f"pull {adapter_id} failed", logging.WARNING, adapter=adapter_id, peers=",".join(peers), duration_s=round(elapsed, 6),
                  outcome=outcome_of(exc), error=type(exc).__name__)
            raise
        elapsed = time.monotonic() - started
        metrics.PULLS.labels(metrics.OK).inc()
        metrics.PULL_SECONDS.labels("ok").observe(elapsed)
        known = set(self.known_peers()) | set(peers)
        for peer, moved in getattr(stats, "peer_bytes", {}).items():  # per-peer bytes (counted by adapter_fabric.transport.swarm_fetch)
            metrics.PULL_BYTES.labels(metrics.peer_label(peer, known)).inc(moved)
        if stats.resumed_from:
            metrics.PULL_RESUMES.inc()
        metrics.PULL_FAILOVERS.inc(stats.failovers)
        event(pull_log, f"pull {adapter_id} ok", adapter=adapter_id, digest=manifest.digest, peer=",".join(stats.source_peers) or None,
              bytes=stats.bytes_transferred, resumed_from=stats.resumed_from or None, failovers=stats.failovers or None,
              shared=stats.shared or None, duration_s=round(elapsed, 6), outcome=metrics.OK)
        return manifest, stats


def refresh_gauges(store: AdapterStore, model: MultiLoraModel | None, adapter_labels: bool = False) -> Callable[[], None]:
    """A scrape hook setting the slot and store gauges from their current state.

    ``adapter_labels`` (--metrics-adapter-labels): name each resident adapter by id. Off, its ``adapter`` label is empty:
    /metrics answers anyone who reaches the port, and an id would tell one tenant what another has resident.
    """

    def refresh() -> None:
        metrics.STORE_USED.set(store.usage())
        metrics.STORE_QUOTA.set(store.max_bytes or 0)
        metrics.RESIDENT.clear()
        slots = model.slots_info() if model is not None else []
        metrics.SLOTS.set(len(slots))
        metrics.SLOTS_FILLED.set(sum(1 for s in slots if s.name is not None))
        metrics.SLOTS_PINNED.set(sum(1 for s in slots if s.pinned))
        metrics.SLOTS_BUSY.set(sum(1 for s in slots if s.ref_count > 0))
        for s in slots:
            if s.name is not None:
                name = s.name if adapter_labels else ""
                metrics.RESIDENT.labels(str(s.slot), name, f"{s.content_id:x}" if isinstance(s.content_id, int) else str(s.content_id)).set(1)

    return refresh
