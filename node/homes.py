"""The node's part in a fleet: the members, each adapter's homes, and the calls placement makes (docs/ARCHITECTURE.md,
"Homes, not broadcast").

- **Lookups** (``find``): a pull that names no peer asks the id's homes (``Locate`` with ``at_home``: a home answers
  from what it holds and the holders that told it, asking nobody), probes the holders they name for their load
  (``Availability``: its own count of the streams it serves), and fans out beyond the homes only when a home could
  not be asked or the node has nothing else to try, counted (``fabric_lookup_fanouts_total``) and logged. The policy is
  ``adapter_fabric.transport.lookup``'s; a member that does not answer is marked down for a while (``MemberView``).
- **Answering as a home** (``answer``, ``told``): this node's own holding of an id, and the holders that announced it
  (``HolderDirectory``, bounded); an announcement is taken from a member only.
- **Publishing and re-homing** (``publish``, ``announce``, ``watch``): a Stage's node has each home pull the adapter
  from it (a stage-only Promote naming this node, as a hand-off does), and a node that pulled an adapter it is no
  home of tells the homes; after the members change, each former home pushes what it holds to the new homes
  (``adapter_fabric.transport.rehoming``), and a node holding a copy of an id it is no home of (any more) tells the
  homes that did not know of it. A node's start is no change of members: the members it first knows are its baseline,
  and it pushes and tells nothing for them. Pushes and announcements run in the background, ``CONCURRENT`` at a time,
  at most ``MAX_QUEUED`` waiting (more are dropped and counted: the lookup still finds the holder that published).

Every call here has a deadline; none runs under a store lock (the peer-call layer checks it).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import partial

import grpc

from adapter_fabric.errors import AdapterNotFound, FabricError, InvalidArgument, PermissionDenied
from adapter_fabric.node.handoff import HANDOFF_TIMEOUT_S, dialable
from adapter_fabric.node.keyed_jobs import MAX_QUEUED, KeyedJobs
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import Candidate
from adapter_fabric.store.ids import validate_adapter_id, validate_digest
from adapter_fabric.transport import discovery, rehoming
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.endpoint_slices import SliceWatch, parse_target
from adapter_fabric.transport.holder_directory import HolderDirectory
from adapter_fabric.transport.lookup import Found, Holder, HomeAnswer, Unreachable, find_sources
from adapter_fabric.transport.members import DNS_REFRESH_S, MemberView
from adapter_fabric.transport.placement import Fleet
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

log = logging.getLogger("fabric.node")

#: seconds a home gets to answer a lookup, and a holder a probe of its load (a silent one is marked down)
ASK_TIMEOUT_S = 2.0
#: seconds an announcement gets
ANNOUNCE_TIMEOUT_S = 5.0
#: announcements one re-homing queues at most (more are counted as dropped: a lookup's fan-out still finds those holders);
#: half the announcement queue, so the pulls' own announcements meanwhile still find room
MAX_REHOME_ANNOUNCES = MAX_QUEUED // 2
#: origin-backed digests remembered (the least recently marked go first: then a copy of one counts as possibly the last)
MAX_BACKED = 100_000
#: seconds a starting node waits for the first list of its Service's EndpointSlices (it serves either way after)
FIRST_MEMBERS_S = 10.0


class Homes:
    """Placement on one node: see the module docstring."""

    def __init__(
        self, view: MemberView, k: int, channels: PeerChannels, store: AdapterStore, streams_open: Callable[[], int], *,
        dns: str = "", k8s: str = "", rng: random.Random | None = None,
    ) -> None:  # fmt: skip
        """``k``: homes per id (--homes); ``streams_open``: the Fetch streams this node serves now (its load, as reported);
        ``dns``: --peers-dns, re-resolved every ``DNS_REFRESH_S``; ``k8s``: --peers-k8s, watched."""
        self.view = view
        self.k = k
        self.channels = channels
        self.store = store
        self.streams_open = streams_open
        self.dns = dns
        self.directory = HolderDirectory()
        self._directory_lock = threading.Lock()
        self._rng = rng or random.Random()
        self._jobs = KeyedJobs("homes")  # pushes: each may take a pull's time (HANDOFF_TIMEOUT_S)
        self._tells = KeyedJobs("homes-tell")  # announcements on their own threads: a slow push never holds one up
        self._slices = SliceWatch(parse_target(k8s), self._k8s_members) if k8s else None
        #: the fleet the held adapters were last re-homed for; None until this node knows its first members. A start is no
        #: change of members: the fleets before it are unknown, and the nodes that stayed re-homed for them meanwhile
        self._placed: Fleet | None = None
        #: digests an origin holds (this node fetched them, or a home said it came from one): never a last copy; bounded
        self._backed: OrderedDict[str, str] = OrderedDict()

    def _k8s_members(self, members: frozenset[str]) -> None:
        self.view.update("k8s", members)

    # ------------------------------------------------------------ homes

    def homes_of(self, adapter_id: str) -> list[str]:
        return self.view.fleet().homes(adapter_id, self.k)

    def is_home(self, adapter_id: str) -> bool:
        me = self.view.me
        return me is not None and me in self.homes_of(adapter_id)

    def live_homes(self, victim: Candidate) -> list[str]:
        """A last copy's live homes but this node, first home first: whom a hand-off asks to take it (``node.handoff``)."""
        return self.view.live(dict.fromkeys(h for i in victim.ids for h in self.homes_of(i)))

    def home_ids(self, adapter_ids: list[str]) -> set[str]:
        """Which of ``adapter_ids`` this node is a home of (one pass over the fleet's scores for all of them)."""
        me = self.view.me
        if me is None or not adapter_ids:
            return set()
        return {a for a, homes in zip(adapter_ids, self.view.fleet().homes_of_many(adapter_ids, self.k), strict=True) if me in homes}

    # ------------------------------------------------------------ origin-backed digests

    def mark_backed(self, digest: str, origin: str) -> None:
        """``digest`` came from ``origin`` (which holds it): said to lookups at this node, and never a last copy here."""
        with self._directory_lock:
            self._backed.pop(digest, None)
            self._backed[digest] = origin
            while len(self._backed) > MAX_BACKED:
                self._backed.popitem(last=False)

    def backed(self, digest: str) -> str:
        """The origin ``digest`` came from, when this node knows it did ("" otherwise)."""
        with self._directory_lock:
            return self._backed.get(digest, "")

    # ------------------------------------------------------------ lookups (an I/O thread)

    def find(self, adapter_id: str, channels: PeerChannels | None = None, fan_out: bool = False) -> Found:
        """Where ``adapter_id`` can be pulled from (``lookup.find_sources`` over gRPC); ``channels``: the caller's view
        of the peer channels (a pull for a caller carries its authority). Blocking."""
        channels = channels or self.channels
        fleet = self.view.fleet()
        homes = fleet.homes(adapter_id, self.k)
        digest: list[str] = []

        def ask(member: str) -> HomeAnswer:
            metrics.LOOKUP_CALLS.labels("home" if member in homes else "fanout").inc()
            answer = self._ask(channels, member, adapter_id)
            digest.extend([answer.digest] if answer.digest and not digest else [])
            return answer

        def probe(member: str) -> Holder:
            metrics.LOOKUP_CALLS.labels("probe").inc()
            return self._probe(channels, member, digest[0] if digest else "")

        found = find_sources(
            homes, ask, beyond=lambda: fleet.ranked(adapter_id, self.k + 16)[self.k :], probe=probe, skip=self.view.down(),
            me=self.view.me, probes=max(0, self.k - 1), fan_out=fan_out, rng=self._rng,
        )  # fmt: skip
        if found.fanned_out:
            metrics.LOOKUP_FANOUTS.inc()
            event(log, "lookup fanned out beyond the homes", logging.WARNING, adapter=adapter_id, homes=",".join(homes),
                  asked=found.fanned_out, found=",".join(found.sources) or "-")  # fmt: skip
        return found

    def _ask(self, channels: PeerChannels, member: str, adapter_id: str) -> HomeAnswer:
        stub = fabric_pb2_grpc.FabricStub(channels.get(member))
        try:
            reply = stub.Locate(fabric_pb2.LocateRequest(adapter_id=adapter_id, at_home=True), timeout=ASK_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, peer=member)
            if isinstance(error, (AdapterNotFound, PermissionDenied)):
                return HomeAnswer()  # it answered: nothing it may show this caller
            self.view.mark_down(member, str(error))
            raise Unreachable(member) from None
        self.view.mark_up(member)
        holders = tuple(
            Holder(h.address, h.complete, h.streams if h.HasField("streams") else -1) for h in reply.peers[:64] if h.address and len(h.address) <= 300
        )
        return HomeAnswer(reply.digest if len(reply.digest) == 64 else "", holders, reply.origin[:1000])

    def _probe(self, channels: PeerChannels, member: str, digest: str) -> Holder:
        stub = fabric_pb2_grpc.FabricStub(channels.get(member))
        try:
            reply = stub.Availability(fabric_pb2.AvailabilityRequest(digest=digest), timeout=ASK_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, peer=member)
            if not isinstance(error, (AdapterNotFound, PermissionDenied)):
                self.view.mark_down(member, str(error))
            raise Unreachable(member) from None
        return Holder(member, reply.complete, reply.streams)

    # ------------------------------------------------------------ answering as a home (an I/O thread)

    def answer(self, adapter_id: str, digest: str = "") -> fabric_pb2.LocateResponse:
        """A lookup at this node as a home: its own holding and the holders that told it; asks nobody."""
        adapter_id = validate_adapter_id(adapter_id)
        holders: list[fabric_pb2.PeerHolding] = []
        me = self.view.me
        try:
            held = self.store.get(adapter_id).digest
        except AdapterNotFound:
            held = ""
        if held and me is not None and (not digest or digest == held):
            holders.append(fabric_pb2.PeerHolding(address=me, complete=True, streams=self.streams_open()))
        with self._directory_lock:
            told = self.directory.holders(adapter_id, time.monotonic(), digest or held)
        holders += [fabric_pb2.PeerHolding(address=t.address, complete=t.complete) for t in told if t.address != me and t.address in self.view.fleet()]
        digest = held or (told[0].digest if told else "")
        return fabric_pb2.LocateResponse(digest=digest, peers=holders, origin=self.backed(digest) if digest else "")

    def told(self, request: fabric_pb2.AnnounceRequest) -> fabric_pb2.AnnounceResponse:
        """A holder's announcement: kept when it comes from a member (as it names itself) about a valid id and digest."""
        adapter_id = validate_adapter_id(request.adapter_id)
        address = request.address.lower()
        if len(address) > 300 or address not in self.view.fleet():
            raise InvalidArgument(f"Announce from {request.address[:100]!r}: not a member of this node's fleet (--peers, --peers-dns, --peers-k8s)")
        with self._directory_lock:
            if request.dropped:
                self.directory.dropped(adapter_id, address)
            else:
                self.directory.told(adapter_id, address, validate_digest(request.digest), request.complete, time.monotonic())
        return fabric_pb2.AnnounceResponse()

    # ------------------------------------------------------------ publishing (called once a commit is done)

    def published(self, adapter_id: str, digest: str) -> None:
        """A Stage committed here: the homes pull it from this node; until they hold it, they name this node."""
        self.announce(adapter_id, digest)
        for home in self.view.live(self.homes_of(adapter_id)):
            self.push(adapter_id, home, "publish")

    def origin_fetched(self, adapter_id: str, digest: str, origin: str) -> None:
        """This node fetched ``adapter_id`` from ``origin``: backed, and its other homes pull it from here."""
        self.mark_backed(digest, origin)
        self.published(adapter_id, digest)

    def announce(self, adapter_id: str, digest: str, dropped: bool = False) -> None:
        """Tell each live home of ``adapter_id`` that this node holds it (or dropped it), in the background."""
        me = self.view.me
        if me is None or self.is_home(adapter_id):
            return
        for home in self.view.live(self.homes_of(adapter_id)):
            self._tell(home, adapter_id, digest, dropped)

    def _tell(self, home: str, adapter_id: str, digest: str, dropped: bool = False) -> bool:
        """Announce this node's copy of ``adapter_id`` (or its drop) to ``home`` in the background; False when not queued."""
        me = self.view.me
        if me is None:
            return False
        request = fabric_pb2.AnnounceRequest(adapter_id=adapter_id, digest=digest, complete=True, dropped=dropped, address=me)
        return self._tells.submit(("announce", adapter_id, home, dropped), partial(self._announce, home, request))

    def _announce(self, home: str, request: fabric_pb2.AnnounceRequest) -> None:
        try:
            fabric_pb2_grpc.FabricStub(self.channels.get(home)).Announce(request, timeout=ANNOUNCE_TIMEOUT_S)
            metrics.ANNOUNCES.labels(metrics.OK).inc()
        except grpc.RpcError as exc:
            metrics.ANNOUNCES.labels("failed").inc()
            log.info("announcing %s to home %s: %s", request.adapter_id, home, error_from_rpc(exc, peer=home))

    def push(self, adapter_id: str, home: str, why: str) -> bool:
        """Have ``home`` pull ``adapter_id`` from this node (a stage-only Promote naming this node), in the background."""
        queued = self._jobs.submit(("push", adapter_id, home), lambda: self.pull_onto(home, adapter_id, why))
        if not queued:
            metrics.HOME_PUSHES.labels(why, "dropped").inc()
        return queued

    def pull_onto(self, home: str, adapter_id: str, why: str, timeout: float = HANDOFF_TIMEOUT_S) -> bool:
        """``home`` pulls ``adapter_id`` from this node now; true once it holds it. Blocking."""
        try:
            me = self.view.me or dialable(self.view.listen, home)
        except (OSError, FabricError) as exc:
            log.warning("cannot tell %s where to pull %s from: %s", home, adapter_id, exc)
            return False
        request = fabric_pb2.PromoteRequest(peer=me, adapter_id=adapter_id, stage_only=True, named_peer_only=True)
        try:
            fabric_pb2_grpc.FabricStub(self.channels.get(home)).Promote(request, timeout=timeout)
        except grpc.RpcError as exc:
            metrics.HOME_PUSHES.labels(why, "failed").inc()
            log.warning("home %s did not pull %s (%s): %s", home, adapter_id, why, error_from_rpc(exc, peer=home))
            return False
        metrics.HOME_PUSHES.labels(why, metrics.OK).inc()
        return True

    def fetch_at(self, home: str, adapter_id: str, channels: PeerChannels | None = None, timeout: float = HANDOFF_TIMEOUT_S) -> None:
        """Have ``home`` bring ``adapter_id`` (a stage-only Promote naming no peer: it resolves the miss itself, from its
        homes or its origins; concurrent asks join one fetch there). ``channels``: the caller's view (it names the caller the
        fetch is for). Blocking; a home that does not answer is marked down."""
        request = fabric_pb2.PromoteRequest(adapter_id=adapter_id, stage_only=True)
        try:
            fabric_pb2_grpc.FabricStub((channels or self.channels).get(home)).Promote(request, timeout=timeout)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, peer=home)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.view.mark_down(home, str(error))
            raise error from None

    # ------------------------------------------------------------ membership and re-homing (the event loop)

    def start(self) -> None:
        """Resolve --peers-dns once, start watching --peers-k8s and wait (at most ``FIRST_MEMBERS_S``) for its first list: a
        node that published before it knew its members would push to the wrong homes (re-homing would mend it later).
        Blocking."""
        if self.dns:  # the first resolution now: members (and their credentials) are known before the node serves
            try:
                self.view.update("dns", discovery.resolve(self.dns))
            except OSError as exc:
                log.warning("peer discovery: %s did not resolve (%s); it is asked again every %gs", self.dns, exc, DNS_REFRESH_S)
        if self._slices is not None:
            self._slices.start()
            if not self._slices.listed.wait(FIRST_MEMBERS_S):
                log.warning("--peers-k8s: no list of the Service's EndpointSlices within %gs; serving with %d members meanwhile",
                            FIRST_MEMBERS_S, len(self.view.fleet()))  # fmt: skip

    async def watch(self, io: Callable[..., Awaitable]) -> None:
        """Every ``DNS_REFRESH_S``: resolve --peers-dns, show the members, and re-home what this node holds when they changed."""
        while True:
            if self.dns:
                try:
                    self.view.update("dns", await io(discovery.resolve, self.dns))
                except OSError as exc:
                    log.warning("peer discovery: %s did not resolve (%s); keeping its last members", self.dns, exc)
            down = len(self.view.down())
            metrics.MEMBERS.labels("down").set(down)
            metrics.MEMBERS.labels("up").set(len(self.view.fleet()) - down)
            fleet = self.view.fleet()
            if self._placed is None:
                if self._members_known():
                    self._placed = fleet
            elif fleet.members != self._placed.members:
                before, self._placed = self._placed, fleet
                try:
                    await io(self.rehome, before, fleet)
                except (OSError, FabricError) as exc:  # the store unreadable now: this loop goes on watching the members
                    log.warning("re-homing after the members changed failed: %s", exc)
            await asyncio.sleep(DNS_REFRESH_S)

    def _members_known(self) -> bool:
        """Every source of members answered once: --peers-dns resolved, --peers-k8s listed (--peers is known at start)."""
        return (not self.dns or self.view.answered("dns")) and (self._slices is None or self._slices.listed.is_set())

    def rehome(self, before: Fleet, after: Fleet) -> int:
        """After the members changed: push what this node holds to the homes it gained (``rehoming.pushes``), then tell the
        homes that do not know of this node's other copies (``rehoming.announcements``: at most ``MAX_REHOME_ANNOUNCES``,
        on the announcements' own threads, so a slow push never holds one up); how many pushes."""
        held = self.store.census()[0]  # the sound ids, kept in memory: reading every ref took ~1 s at 100,000
        to_push, to_tell = rehoming.plan(held, before, after, self.view.me, self.k)
        pushes = 0
        for adapter_id, arrivals in to_push.items():
            for home in self.view.live(arrivals):
                pushes += self.push(adapter_id, home, "rehome")
        told, dropped = self._announce_copies(to_tell)
        event(log, "members changed: re-homing", members=len(after), held=len(held), pushes=pushes, announced=told, not_announced=dropped)
        return pushes

    def _announce_copies(self, to_tell: dict[str, list[str]]) -> tuple[int, int]:
        """Tell each id's live homes in ``to_tell`` of this node's copy, at most ``MAX_REHOME_ANNOUNCES`` queued, each
        digest read from its ref when it is told (an id unstaged since is skipped); (queued, dropped)."""
        told = dropped = 0
        for adapter_id, homes in to_tell.items():
            live = self.view.live(homes)
            if told >= MAX_REHOME_ANNOUNCES:
                dropped += len(live)
                continue
            digest = self.store.digest_of(adapter_id) if live else None
            if digest is None:
                continue  # no live home, or unstaged since the plan
            for home in live:
                if told < MAX_REHOME_ANNOUNCES and self._tell(home, adapter_id, digest):
                    told += 1
                else:
                    dropped += 1
        if dropped:
            metrics.ANNOUNCES.labels("dropped").inc(dropped)
        return told, dropped

    def close(self) -> None:
        if self._slices is not None:
            self._slices.close()
        self._jobs.close()
        self._tells.close()



