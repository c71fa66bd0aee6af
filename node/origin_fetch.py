"""The node's miss path: an adapter from the fabric first (the node's peers), then from its origins; ids that follow their origin.

``OriginFetches.resolve`` is the one node-level entry a request without a peer goes through (a Promote or a
``fabric pull`` without ``--from``, the vLLM resolver's pull). In order:

1. Held here, and either not from an origin, pinned (``ID@REVISION``), or checked within ``--origin-ttl``:
   answered at once.
2. Held, from an origin, checked longer ago than the TTL: revalidated with a conditional request. Unchanged:
   the check time moves on. Changed: the new content is staged under the same id (a new digest; the old one
   stays readable for whoever opened it, and goes once no ref reaches it), and ``on_move`` tells the engines.
   The origin down, or its new content refused: the held digest is served on, with a warning and the
   origin's state in store-status.
3. Not held: the known peers (a pull, every check of a pull), then each origin in turn. An origin's content
   is checked like a Stage's (``DirectoryStager``: strict format, size bounds before any byte is written,
   this node's model), and on a node with ``--trusted-signers`` only a ``#trusted`` origin's unsigned content
   is taken. A miss everywhere is refused naming each origin and why.

Concurrent requests for one id join one flight (a task of its own: a caller that goes away does not cancel
it); at most ``--origin-concurrency`` origin fetches run at once. Every fetch runs on an I/O thread, outside
every store lock, under its origin's whole-fetch deadline (invariant 17). Access is checked at the service
edge before this runs, on the caller's own grants: a caller without the verb on the id gets nothing from an
origin either (invariant 18).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from adapter_fabric.access.policy import CLUSTER, Principal, identity_of
from adapter_fabric.errors import AdapterNotFound, FabricError, OriginUnavailable, PeerUnavailable, PermissionDenied, Untrusted
from adapter_fabric.node.authority import pull_authority
from adapter_fabric.node.home_route import HomeRoute
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.origins.base import FetchLimits, Origin, Revision
from adapter_fabric.origins.records import RevisionRecord, RevisionRecords
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.ids import split_pin
from adapter_fabric.store.lock_watch import check_no_store_lock
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import MakeRoom, opened_with_room
from adapter_fabric.transport.pull import PullStats

log = logging.getLogger("fabric.node")

#: the default of --origin-ttl: how stale an id fetched from an origin may be before a request revalidates it
DEFAULT_TTL_S = 300.0
#: the default of --origin-concurrency: origin fetches one node runs at once (each is one adapter's two files)
DEFAULT_CONCURRENCY = 4
_DIGEST_CHARS = frozenset("0123456789abcdef")


def _allowed(may_fetch: Callable[[], None] | None) -> bool:
    try:
        if may_fetch is not None:
            may_fetch()
    except PermissionDenied:
        return False
    return True


#: a miss through the fleet first (``node.home_route.HomeRoute``), with the caller and its authority (``pull_authority``):
#: (manifest, stats) pulled, or None to fetch it here
Route = Callable[[str, Callable[[Manifest], None] | None, Principal, dict], Awaitable[tuple[Manifest, PullStats] | None]]


class NodeContext(Protocol):
    """What this needs of ``node.context.NodeContext`` (which holds this object: named here, not imported)."""

    store: AdapterStore
    model: Any

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def known_peers(self) -> list[str]: ...


@dataclass(frozen=True)
class Resolved:
    """What a request without a peer gets: the manifest, how it came, and (from an origin) its revision."""

    manifest: Manifest
    stats: PullStats
    source: str  # "store", "peer" or the origin's label
    record: RevisionRecord | None = None

    @property
    def origin(self) -> str:
        return self.record.revision.origin if self.record is not None else ""

    @property
    def revision(self) -> str:
        return self.record.revision.revision if self.record is not None else ""


@dataclass
class OriginState:
    """How an origin answered last (shown by store-status)."""

    label: str
    answering: bool = True
    error: str = ""
    since: float = 0.0  # wall clock of the last change of state


class OriginFetches:
    """Every request without a peer, on one node: held, from a peer, or from an origin (see the module docstring)."""

    def __init__(
        self, context: NodeContext, signed: SignedAdapters, origins: list[Origin], records: RevisionRecords, ttl: float = DEFAULT_TTL_S,
        concurrency: int = DEFAULT_CONCURRENCY, admit: Callable[[Manifest], None] | None = None, make_room: MakeRoom | None = None,
        route: Route | None = None, on_fetched: Callable[[str, str, str], None] | None = None,
    ) -> None:  # fmt: skip
        """``admit``: this node's own check of what it takes (its model's modules and shapes), before anything is committed;
        ``make_room``: asked when the store refuses a commit for room (the node's evictor)."""
        self.make_room = make_room
        #: with placement: the fleet first (``node.home_route``), before this node's origins; ``on_fetched(id, digest, origin)``:
        #: after this node fetched an id from an origin (its other homes pull it)
        self.route = route
        self.on_fetched = on_fetched
        self.context = context
        self.store = context.store
        self.signed = signed
        self.origins = origins
        self.records = records
        self.ttl = ttl
        self.admit = admit
        self.states = {o.label: OriginState(o.label) for o in origins}
        #: called (on the event loop) after an id moved to a new digest: (id, old digest, new digest); engines act on it
        self.on_move: list[Callable[[str, str, str], Awaitable[None] | None]] = []
        self._flights: dict[str, asyncio.Task] = {}
        self._limit = asyncio.Semaphore(concurrency)

    # ------------------------------------------------------------ entry

    async def resolve(
        self, adapter_id: str, check: Callable[[Manifest], None] | None = None, flight: str = "", may_fetch: Callable[[], None] | None = None,
        who: Principal = CLUSTER,
    ) -> Resolved:
        """The adapter ``adapter_id`` names now (see the module docstring); AdapterNotFound or OriginUnavailable naming why not.

        ``check``: the caller's own refusal (an engine's base model), made before any byte of a miss moves and before
        anything is committed; callers with another ``flight`` (the check's key) never share a fetch. ``may_fetch``: raises
        unless the caller may have the bytes brought for it (its own grants: invariant 18); without it, a held id is
        answered as held (no revalidation) and a miss is refused by it, before any peer or origin is asked. ``who``: the
        caller a miss is fetched for: its peers are told who, and bytes held here under other ids go under ``adapter_id``
        (an ``ID@DIGEST`` pin) only if it may pull one of those ids (``node.authority``); a restricted caller's miss is
        not shared with another caller's.
        """
        held = await self.context.io(self._held, adapter_id)
        if held is not None:
            record = self._record(adapter_id, held.digest)
            if record is None or record.pinned or not self.stale(adapter_id, held.digest, record) or not _allowed(may_fetch):
                resolved = Resolved(held, PullStats(), "store", record)
            else:
                resolved = await self._joined(adapter_id, lambda: self._revalidate(adapter_id, held, record))
        else:
            if may_fetch is not None:
                may_fetch()
            own = "" if who.may_everywhere("pull") else identity_of(who) or who.name
            resolved = await self._joined(f"{adapter_id}\0{flight}\0{own}", lambda: self._miss(adapter_id, check, who))
        if check is not None:
            check(resolved.manifest)
        return resolved

    def stale(self, adapter_id: str, digest: str, record: RevisionRecord | None = None) -> bool:
        """Whether ``digest`` came to ``adapter_id`` from one of this node's origins longer ago than --origin-ttl (unpinned)."""
        record = record if record is not None else self._record(adapter_id, digest)
        return record is not None and not record.pinned and time.time() - record.checked_at >= self.ttl and self._origin(record) is not None

    def record_of(self, adapter_id: str, digest: str) -> RevisionRecord | None:
        """The revision record of ``adapter_id`` while it names ``digest`` (None: not from an origin). Blocking (one small read)."""
        return self._record(adapter_id, digest)

    async def _joined(self, adapter_id: str, make: Callable[[], Awaitable[Resolved]]) -> Resolved:
        flight = self._flights.get(adapter_id)
        if flight is None:
            flight = asyncio.ensure_future(make())
            self._flights[adapter_id] = flight
            flight.add_done_callback(lambda done: (self._flights.pop(adapter_id, None), done.cancelled() or done.exception()))
        return await asyncio.shield(flight)

    # ------------------------------------------------------------ held

    def _held(self, adapter_id: str) -> Manifest | None:
        try:
            return self.store.get(adapter_id)
        except AdapterNotFound:
            return None

    def _record(self, adapter_id: str, digest: str) -> RevisionRecord | None:
        record = self.records.get(adapter_id)
        return record if record is not None and record.digest == digest else None

    def _origin(self, record: RevisionRecord) -> Origin | None:
        return next((o for o in self.origins if o.label == record.revision.origin), None)

    async def _revalidate(self, adapter_id: str, held: Manifest, record: RevisionRecord) -> Resolved:
        origin = self._origin(record)
        assert origin is not None
        try:
            async with self._limit:
                fetched = await self.context.io(self._fetch_and_stage, origin, adapter_id, "", record.revision, self.admit)
        except FabricError as exc:
            # Held content is served on: an origin down (or its new content refused) never takes an id away.
            metrics.ORIGIN_REVALIDATIONS.labels(origin.label, "failed").inc()
            event(log, "revalidation failed: serving the held digest", logging.WARNING, adapter=adapter_id, origin=origin.label,
                  digest=held.digest[:12], error=str(exc)[:300])  # fmt: skip
            return Resolved(held, PullStats(), "store", record)
        if fetched is None:
            metrics.ORIGIN_REVALIDATIONS.labels(origin.label, "unchanged").inc()
            fresh = replace(record, checked_at=time.time())
            await self.context.io(self.records.put, adapter_id, fresh)
            return Resolved(held, PullStats(), "store", fresh)
        manifest, new, stats = fetched
        metrics.ORIGIN_REVALIDATIONS.labels(origin.label, "changed" if manifest.digest != held.digest else "unchanged").inc()
        if manifest.digest != held.digest:
            event(log, "id moved to its origin's new revision", adapter=adapter_id, origin=origin.label, old=held.digest[:12],
                  new=manifest.digest[:12], revision=new.revision.revision[:80])  # fmt: skip
            await self._moved(adapter_id, held.digest, manifest.digest)
        return Resolved(manifest, stats, origin.label, new)

    async def _moved(self, adapter_id: str, old: str, new: str) -> None:
        for listener in self.on_move:
            try:
                result = listener(adapter_id, old, new)
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:  # noqa: BLE001 (a listener's failure is logged; the move stands)
                log.warning("after %s moved to %s: %s: %s", adapter_id, new[:12], type(exc).__name__, exc)

    # ------------------------------------------------------------ miss

    async def _miss(self, adapter_id: str, check: Callable[[Manifest], None] | None, who: Principal = CLUSTER) -> Resolved:
        admit = self._admit_with(check)
        base, pin = split_pin(adapter_id)
        authority = pull_authority(who, self.store)
        if pin and len(pin) == 64 and set(pin) <= _DIGEST_CHARS:
            local = await self.context.io(self._by_digest, adapter_id, pin, authority.get("may_reuse"))
            if local is not None:
                return Resolved(local, PullStats(), "store")
        if self.route is not None:
            routed = await self.route(adapter_id, admit, who, authority)
            if routed is not None:
                return Resolved(*routed, "peer")
        peers = await self.context.known_peers() if self.route is None else []
        if peers:
            try:
                manifest, stats = await self.context.io(self.signed.pull, peers, adapter_id, admit, None, who, **authority)
                return Resolved(manifest, stats, "peer")
            except (AdapterNotFound, PeerUnavailable, Untrusted) as exc:
                if not self.origins:
                    raise
                log.info("%s: no known peer gave it (%s); asking its origins", adapter_id, str(exc)[:200])
        if not self.origins:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged on this node, no known peer holds it, and the node has no --origin")
        reasons: list[str] = []
        down: list[FabricError] = []
        for origin in self.origins:
            if self.signed.trusted.required and not origin.trusted:
                reasons.append(f"{origin.label}: not asked: this node takes only signed adapters (--trusted-signers) and the origin is not marked #trusted")
                continue
            try:
                async with self._limit:
                    fetched = await self.context.io(self._fetch_and_stage, origin, adapter_id, pin, None, admit)
            except AdapterNotFound as exc:
                reasons.append(str(exc))
                continue
            except OriginUnavailable as exc:
                reasons.append(str(exc))
                down.append(exc)
                continue
            assert fetched is not None  # nothing was known, so the origin answers content or an error
            manifest, record, stats = fetched
            if self.on_fetched is not None:
                self.on_fetched(adapter_id, manifest.digest, origin.label)
            return Resolved(manifest, stats, origin.label, record)
        summary = f"adapter {adapter_id!r} is not held here, no known peer has it, and no origin gave it: " + "; ".join(reasons)
        if down:
            raise OriginUnavailable(summary)
        if reasons and all("not asked" in r for r in reasons):
            raise Untrusted(summary)
        raise AdapterNotFound(summary)

    def _by_digest(self, adapter_id: str, digest: str, may_reuse: Callable[[str], bool] | None = None) -> Manifest | None:
        """``ID@DIGEST`` when those bytes are here under another id the caller may pull (``may_reuse``; None: any): a ref to
        them, nothing fetched. Otherwise None: the bytes must come from a peer or an origin, as a miss's do."""
        manifest = self.store.by_digest(digest)
        if manifest is None or (may_reuse is not None and not may_reuse(digest)):
            return None
        return self.store.refer(manifest.with_id(adapter_id))

    # ------------------------------------------------------------ one origin fetch (an I/O thread)

    def _admit_with(self, check: Callable[[Manifest], None] | None) -> Callable[[Manifest], None] | None:
        """This node's check, then the caller's."""
        if check is None or self.admit is None:
            return check or self.admit
        admit = self.admit

        def both(manifest: Manifest) -> None:
            admit(manifest)
            check(manifest)

        return both

    def _fetch_and_stage(
        self, origin: Origin, adapter_id: str, pin: str, known: Revision | None, admit: Callable[[Manifest], None] | None = None
    ) -> tuple[Manifest, RevisionRecord, PullStats] | None:
        """Fetch into a scratch directory and stage it under ``adapter_id``; None when ``known`` is still current."""
        base, _ = split_pin(adapter_id)
        digest_pin = pin if len(pin) == 64 and set(pin) <= _DIGEST_CHARS else ""
        scratch = self.records.scratch()
        what = f"origin {origin.label}: {adapter_id}"
        started = time.monotonic()
        try:
            limits = FetchLimits(self.store.max_adapter_bytes or (1 << 40), origin.timeout)
            check_no_store_lock(f"a fetch from origin {origin.label}")  # invariant 17: never under a store lock
            try:
                revision = origin.fetch(base, "" if digest_pin else pin, known, scratch, limits)
            except FabricError as exc:
                self._failed(origin, exc)
                raise
            self._answered(origin)
            if revision is None:
                return None
            received = sum(p.stat().st_size for p in scratch.iterdir())
            metrics.ORIGIN_BYTES.labels(origin.label).inc(received)

            def check(manifest: Manifest) -> None:
                if digest_pin and manifest.digest != digest_pin:
                    raise AdapterNotFound(f"{what}: the origin's content has digest {manifest.digest}, not the pinned {digest_pin}")
                if admit is not None:
                    admit(manifest)

            try:
                # At the store's limit the node's evictor makes room, outside every store lock, and the stage runs once more.
                manifest = opened_with_room(lambda: self.store.stage(scratch, adapter_id, check=check), self.make_room)
            except FabricError as exc:
                metrics.ORIGIN_FETCHES.labels(origin.label, type(exc).__name__).inc()
                raise type(exc)(f"{what}: refused, nothing staged: {exc}") from None
            if origin.trusted:
                self.signed.trusted.vouch(manifest.digest)
            record = RevisionRecord(manifest.digest, revision, time.time(), pinned=bool(pin), vouched=origin.trusted)
            self.records.put(adapter_id, record)
            metrics.ORIGIN_FETCHES.labels(origin.label, metrics.OK).inc()
            event(log, "fetched from origin", adapter=adapter_id, origin=origin.label, revision=revision.revision[:80],
                  digest=manifest.digest[:12], bytes=received)  # fmt: skip
            stats = PullStats(digest=manifest.digest, bytes_transferred=manifest.weights.size, source_peers=[origin.label],
                              pull_seconds=time.monotonic() - started)  # fmt: skip
            return manifest, record, stats
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _failed(self, origin: Origin, exc: FabricError) -> None:
        kind = type(exc).__name__
        metrics.ORIGIN_FETCHES.labels(origin.label, kind).inc()
        if isinstance(exc, AdapterNotFound):
            return  # it answered: the adapter is not there
        metrics.ORIGIN_ERRORS.labels(origin.label, kind).inc()
        state = self.states[origin.label]
        if isinstance(exc, OriginUnavailable) or kind == "OriginTooSlow":
            if state.answering or state.error != str(exc)[:300]:
                event(log, "origin not answering: ids it gave are served as held", logging.WARNING, origin=origin.label, error=str(exc)[:300])
            state.answering, state.error, state.since = False, str(exc)[:300], time.time()

    def _answered(self, origin: Origin) -> None:
        state = self.states[origin.label]
        if not state.answering:
            event(log, "origin answering again", origin=origin.label)
        state.answering, state.error, state.since = True, "", time.time()

    def vouch_from_records(self) -> None:
        """A trusting node's start: the digests trusted origins gave (in their records) are vouched for again. Blocking."""
        for record in self.records.each():
            if record.vouched:
                self.signed.trusted.vouch(record.digest)


def build_origin_fetches(
    settings, context: NodeContext, signed: SignedAdapters, make_room: MakeRoom | None = None, homes: Homes | None = None
) -> OriginFetches:
    """The node's OriginFetches from its settings (--origin, --origin-ttl, --origin-timeout, --origin-concurrency).

    One self-contained object: whatever composes the node (and, later, placement deciding which node fetches) hands it
    the context and the trust checks; a bad origin stops the node at start, naming it.
    """
    from adapter_fabric.origins.uri import open_origin, parse_origin

    origins = [open_origin(parse_origin(uri), default_timeout=settings.origin_timeout) for uri in settings.origin]
    model = context.model
    admit = (lambda manifest: model.check_compatible(manifest.pairs)) if model is not None else None
    fetches = OriginFetches(
        context, signed, origins, RevisionRecords(context.store.root / "origins"), ttl=settings.origin_ttl, concurrency=settings.origin_concurrency,
        admit=admit, make_room=make_room, route=HomeRoute(homes, signed, context.io, bool(origins)) if homes is not None else None,
        on_fetched=homes.origin_fetched if homes is not None else None,
    )  # fmt: skip
    if signed.trusted.required and any(o.trusted for o in origins):
        fetches.vouch_from_records()
    return fetches
