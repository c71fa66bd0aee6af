"""Swarm scheduling: which chunks of an adapter to ask which peer for.

Pure policy over plain data (no sockets, no threads, no clock of its own: the
caller passes ``now``), so it is tested on its own (tests/transport/test_swarm.py). The
swarm download in ``adapter_fabric.transport.swarm_pull`` owns the I/O and feeds this module what happened.

The policy, after BitTorrent:
- every live peer keeps up to ``window`` requests outstanding, so a peer never
  idles for a round trip between two requests;
- a request is a run of consecutive chunks (at most ``max_run``) that the peer
  holds, that this node still needs and that no other request carries;
- the first chunk of a run is the rarest among the peers, ties broken by a
  per-pull random order: nodes of one rollout ask the seeder for different
  chunks, so they soon have something to trade;
- endgame: when a peer has a free slot and nothing fresh to ask for, it
  re-requests the unverified chunks of the oldest request that has been out
  longer than ``endgame_after`` seconds on another peer (one duplicate per
  chunk); whichever copy lands first wins and the other is cancelled.

Serving side (super-seeding, after BitTorrent's): a swarm request also names
the chunks the puller would take instead (``FetchRequest.accept_bitmap``);
the serving node sends, for each requested chunk, one it has handed out least
(``pick_chunks``). Pullers only learn who holds what with a delay, so without
this the seed sends the same chunk to several nodes; with it, its upload
carries every chunk once before any chunk twice.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

#: requests outstanding per peer
WINDOW = 1
#: ... on a pull's only source (unless a window is set): one stream leaves a core idle while its thread receives,
#: hashes, writes and stages each chunk in turn; two run those passes on two cores (measured: an 84 MB promote from
#: one peer, 150-159 ms -> 115-125 ms; the receiver's CPU about the same). A swarm already has a stream per peer.
ONE_SOURCE_WINDOW = 2
#: bytes per request at most: long runs amortize a call's set-up and round trip (measured: 32 MiB runs
#: saved ~25% of an 84 MB one-peer pull against 1 MiB ones); ``run_length`` shortens them to spread a rollout
RUN_BYTES = 32 << 20
#: known peers a pull asks besides the one it names, at most: each is polled every 0.5-2 s while the pull lasts, so a
#: node that knows a thousand members would poll them all (BitTorrent's clients keep a few dozen peers per torrent)
SWARM_PEERS = 32
#: an outstanding request younger than this is never duplicated by the endgame
ENDGAME_MIN_S = 1.0
#: ... nor one younger than this many times the median request time
ENDGAME_FACTOR = 3.0

_ids = itertools.count(1)


@dataclass
class PeerView:
    """What this node knows of one peer."""

    address: str
    have: set[int] = field(default_factory=set)  # verified chunks it announced
    complete: bool = False  # it holds every chunk (committed)
    dead: bool = False  # failed in this pull: never asked again
    inflight: int = 0  # requests outstanding
    resume_at: float = 0.0  # busy (it refused a stream for now): not asked before this time
    cap: int = 0  # requests it takes at once, when fewer than the window (it refused one beside others); 0: the window

    def holds(self, chunk: int) -> bool:
        return self.complete or chunk in self.have


@dataclass
class Request:
    """One Fetch of consecutive chunks from one peer."""

    peer: str
    chunks: list[int]
    started: float
    endgame: bool = False  # a duplicate of chunks another request carries
    id: int = field(default_factory=lambda: next(_ids))
    accept: frozenset[int] = frozenset()  # chunks the peer may send instead (super-seeding); empty = exactly ``chunks``
    delivered: set[int] = field(default_factory=set)  # its chunks it verified itself: it only has its END to read
    beside: bool = False  # made while its peer may take several of ours at once (refused as busy: not sent to gRPC)


def substitutes(plan: SwarmPlan, request: Request) -> frozenset[int]:
    """What ``request`` accepts in place of its chunks: every needed chunk no other request carries or was offered.

    Endgame copies want their chunks exactly; a pull from one peer gains
    nothing from substitutes (it needs every chunk from it anyway).
    """
    if request.endgame or len(plan.peers) < 2:
        return frozenset()
    free = frozenset(c for c in plan.needed if _unclaimed(plan, c))
    return free | frozenset(request.chunks)


def offer(plan: SwarmPlan, request: Request) -> None:
    """Set ``request.accept`` (``substitutes``) and hold its substitutes for it until its peer says what it picked.

    Two peers picking from the same substitutes sent the same chunk at once, and one copy was cut (a fifth of a
    16-node rollout's requests, each a wasted transfer and a connection): a chunk is offered to one request at a
    time, and no fresh request asks for it meanwhile (``retarget`` or ``finish`` lets it go).
    """
    request.accept = substitutes(plan, request)
    for c in request.accept:
        if c not in plan.carriers:
            plan.offered[c] = request.id


def _unclaimed(plan: SwarmPlan, chunk: int) -> bool:
    """No outstanding request carries ``chunk`` and none was offered it: a fresh request or a substitute may take it."""
    return chunk not in plan.carriers and chunk not in plan.offered


def _withdraw(plan: SwarmPlan, request: Request) -> None:
    """``request``'s peer picked (or the request ended): the chunks offered to it are free again."""
    for c in request.accept:
        if plan.offered.get(c) == request.id:
            del plan.offered[c]


@dataclass
class SwarmPlan:
    """The state of one pull: what is needed, who holds what, what is outstanding."""

    chunk_count: int
    needed: set[int]  # chunks not verified here yet
    peers: dict[str, PeerView]  # in preference order
    tiebreak: list[float]  # per-chunk random rank among equally rare chunks
    carriers: dict[int, list[int]] = field(default_factory=dict)  # chunk -> ids of outstanding requests carrying it
    offered: dict[int, int] = field(default_factory=dict)  # chunk -> id of the one request that may pick it (``offer``)
    outstanding: dict[int, Request] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)  # seconds per finished request
    # Rarity, kept as holdings change (set_holding, forget_chunks, mark_dead), not counted over every peer per call:
    # a pull on a node knowing 1,000 members planned for 383 ms of its 84 requests. Live peers holding chunk c:
    # ``whole`` + ``partly[c]``.
    whole: int = 0  # live peers holding every chunk
    partly: list[int] = field(default_factory=list)  # per chunk: live peers, not whole, that announced it

    def __post_init__(self) -> None:
        if not self.partly:
            self.partly = [0] * self.chunk_count


def new_plan(chunk_count: int, verified: Iterable[int], peers: Sequence[str], seed: int | None = None) -> SwarmPlan:
    """A plan for a pull that already holds ``verified`` chunks; ``peers`` in preference order."""
    rng = random.Random(seed)
    done = set(verified)
    views = {address: PeerView(address) for address in dict.fromkeys(peers)}
    # Random first chunks spread a rollout's first copies; from one source, file order keeps each request one run.
    tiebreak = [float(i) for i in range(chunk_count)] if len(views) <= 1 else [rng.random() for _ in range(chunk_count)]
    return SwarmPlan(chunk_count=chunk_count, needed={i for i in range(chunk_count) if i not in done}, peers=views, tiebreak=tiebreak)


def order_chunks(plan: SwarmPlan, in_file_order: bool, rng: random.Random | None = None) -> None:
    """Break ties among equally rare chunks in file order (a lone pull: runs stay whole), or at random (a swarm)."""
    count = plan.chunk_count
    plan.tiebreak = [float(i) for i in range(count)] if in_file_order else [(rng or random).random() for _ in range(count)]


def swarm_peers(named: str, known: Sequence[str], rng: random.Random | None = None, limit: int = SWARM_PEERS) -> list[str]:
    """The peers of a pull that names ``named``: it first, then up to ``limit`` of the ``known`` others, at random when
    there are more (each puller of a large rollout its own sample, so the swarm stays connected)."""
    others = [p for p in dict.fromkeys(known) if p != named]
    if len(others) > limit:
        others = (rng or random).sample(others, limit)
    return [named, *others]


def window_for(peers: int, window: int | None = None, *, several: bool = True) -> int:
    """Requests outstanding per peer for a pull from ``peers`` sources: ``window`` when given, else ONE_SOURCE_WINDOW
    from one source (unless it takes no ``several`` streams of ours at once) and WINDOW from several."""
    if window is not None:
        return window
    return ONE_SOURCE_WINDOW if peers <= 1 and several else WINDOW


def run_length(chunk_size: int, chunk_count: int, peers: int, window: int = WINDOW) -> int:
    """Chunks per request: up to RUN_BYTES, but short enough that every peer's window gets work four times over.

    Measured (bench_swarm, 16 nodes, 64 chunks): one-chunk runs beat two-chunk ones at 50 and at 200 Mbit/s;
    first copies must spread over the swarm quickly. A pull from one peer takes runs of up to RUN_BYTES, of equal
    length, in a number of calls that is a multiple of its window.
    """
    if peers <= 1:  # one source: spreading buys nothing, and every call costs a set-up and a round trip
        calls = window * -(-chunk_count // (window * max(1, RUN_BYTES // chunk_size)))  # a multiple of the window:
        return max(1, -(-chunk_count // calls))  # equal runs, so no stream is left alone with a short tail
    spread = chunk_count // (4 * peers * window)
    return max(1, min(RUN_BYTES // chunk_size, spread))


def set_holding(plan: SwarmPlan, address: str, have: Iterable[int], complete: bool = False) -> None:
    """Record what a peer announced (an Availability answer, or complete for the manifest's source)."""
    peer = plan.peers[address]
    _count(plan, peer, -1)
    peer.complete = complete
    peer.have = set() if complete else {i for i in have if 0 <= i < plan.chunk_count}
    _count(plan, peer, +1)


def forget_chunks(plan: SwarmPlan, address: str, chunks: Iterable[int]) -> None:
    """A peer refused chunks it had announced (it lost them): stop asking it until it announces them again."""
    peer = plan.peers[address]
    _count(plan, peer, -1)
    if peer.complete:
        peer.complete = False
        peer.have = set(range(plan.chunk_count))
    peer.have.difference_update(chunks)
    _count(plan, peer, +1)


def mark_dead(plan: SwarmPlan, address: str) -> None:
    peer = plan.peers[address]
    _count(plan, peer, -1)
    peer.dead = True


def _count(plan: SwarmPlan, peer: PeerView, sign: int) -> None:
    """Add (+1) or take back (-1) a live peer's holdings in the plan's rarity counts."""
    if peer.dead:
        return
    if peer.complete:
        plan.whole += sign
    for chunk in peer.have:
        plan.partly[chunk] += sign


def chunk_verified(plan: SwarmPlan, chunk: int, request: Request | None = None) -> None:
    """``chunk`` was verified, delivered by ``request`` (when one of this plan's)."""
    plan.needed.discard(chunk)
    if request is not None:
        request.delivered.add(chunk)


def live_peers(plan: SwarmPlan) -> list[PeerView]:
    return [p for p in plan.peers.values() if not p.dead]


def endgame_after(plan: SwarmPlan) -> float:
    """Seconds a request must be out before the endgame duplicates it."""
    if not plan.durations:
        return ENDGAME_MIN_S
    return max(ENDGAME_MIN_S, ENDGAME_FACTOR * statistics.median(plan.durations[-32:]))


def plan_requests(plan: SwarmPlan, now: float, window: int = WINDOW, max_run: int = 1) -> list[Request]:
    """New requests that fill every live peer's window; they are registered as outstanding."""
    if all(p.dead or p.inflight >= (p.cap or window) or p.resume_at > now for p in plan.peers.values()):
        return []  # the common case when an event arrives: nothing to do
    wait = endgame_after(plan)
    made: list[Request] = []
    # Round-robin over the peers, one request each per round, so one peer does
    # not take every rare chunk before the others get a turn.
    while True:
        progressed = False
        for peer in plan.peers.values():
            if peer.dead or peer.inflight >= (peer.cap or window) or peer.resume_at > now or not (peer.complete or peer.have):
                continue  # a peer that announced nothing has nothing to ask for, fresh or in the endgame
            request = _fresh(plan, peer, now, max_run) or _endgame(plan, peer, now, wait)
            if request is None:
                continue
            request.beside = (peer.cap or window) > 1
            _register(plan, request)
            made.append(request)
            progressed = True
        if not progressed:
            return made


def _fresh(plan: SwarmPlan, peer: PeerView, now: float, max_run: int) -> Request | None:
    pool = plan.needed if peer.complete else peer.have & plan.needed
    candidates = [c for c in pool if _unclaimed(plan, c)]
    if not candidates:
        return None
    partly, tiebreak = plan.partly, plan.tiebreak  # rarest first: ``whole`` is the same for every chunk
    first = min(candidates, key=lambda c: (partly[c], tiebreak[c]))
    run = [first]
    while len(run) < max_run:
        nxt = run[-1] + 1
        if nxt >= plan.chunk_count or nxt not in plan.needed or not _unclaimed(plan, nxt) or not peer.holds(nxt):
            break
        run.append(nxt)
    return Request(peer=peer.address, chunks=run, started=now)


def _endgame(plan: SwarmPlan, peer: PeerView, now: float, wait: float) -> Request | None:
    for old in sorted(plan.outstanding.values(), key=lambda r: r.started):
        if now - old.started < wait:
            return None  # sorted by age: nothing older follows
        if old.peer == peer.address:
            continue
        run: list[int] = []
        for c in old.chunks:
            duplicable = c in plan.needed and peer.holds(c) and len(plan.carriers.get(c, ())) == 1
            if duplicable and (not run or c == run[-1] + 1):
                run.append(c)
            elif run:
                break
        if run:
            return Request(peer=peer.address, chunks=run, started=now, endgame=True)
    return None


def _register(plan: SwarmPlan, request: Request) -> None:
    plan.outstanding[request.id] = request
    plan.peers[request.peer].inflight += 1
    for c in request.chunks:
        plan.carriers.setdefault(c, []).append(request.id)


def finish(plan: SwarmPlan, request: Request, now: float | None = None) -> None:
    """The request ended (done, failed or cancelled): its unverified chunks are free to ask again."""
    if plan.outstanding.pop(request.id, None) is None:
        return
    _withdraw(plan, request)
    plan.peers[request.peer].inflight -= 1
    for c in request.chunks:
        ids = plan.carriers.get(c)
        if ids is not None and request.id in ids:
            ids.remove(request.id)
            if not ids:
                del plan.carriers[c]
    if now is not None:
        plan.durations.append(now - request.started)


def retarget(plan: SwarmPlan, request: Request, chunks: Sequence[int]) -> None:
    """The peer said which chunks it will send for ``request`` (substitutes): they, not the asked ones, are carried now."""
    if request.id not in plan.outstanding:
        return
    _withdraw(plan, request)
    for c in request.chunks:
        ids = plan.carriers.get(c)
        if ids is not None and request.id in ids:
            ids.remove(request.id)
            if not ids:
                del plan.carriers[c]
    request.chunks = list(chunks)
    for c in request.chunks:
        plan.carriers.setdefault(c, []).append(request.id)


def redundant(plan: SwarmPlan) -> list[Request]:
    """Outstanding requests whose every chunk is verified already, some by another copy (the other endgame copy won): cancel them.

    A request that delivered every chunk itself is not: it has its END to read (what the peer holds now), and its
    connection is kept for the next request only when it reads it (a cancel there cost a new connection per request).
    """
    return [r for r in plan.outstanding.values() if not r.delivered.issuperset(r.chunks) and not any(c in plan.needed for c in r.chunks)]


def pick_chunks(requested: Sequence[int], accept: Iterable[int], holds: Callable[[int], bool], sent: list[int], rng: random.Random) -> list[int]:
    """Chunks to serve for a request that accepts substitutes; ``sent[i]`` (handed-out counts) is bumped.

    For each requested chunk: itself, when this node holds it and has handed
    it out no more than any other acceptable chunk it holds; else one of
    those least handed out (at random, so concurrent requests spread). Fewer
    chunks than requested when this node holds no more acceptable ones.
    """
    pool = {c for c in accept if 0 <= c < len(sent) and holds(c)}
    picked: list[int] = []
    for want in requested:
        if 0 <= want < len(sent) and holds(want):
            pool.add(want)
        if not pool:
            break
        least = min(sent[c] for c in pool)
        choice = want if want in pool and sent[want] == least else rng.choice([c for c in pool if sent[c] == least])
        pool.discard(choice)
        sent[choice] += 1
        picked.append(choice)
    return picked


def bitmap_to_chunks(bitmap: bytes, chunk_count: int) -> set[int]:
    """Chunk indexes set in an AvailabilityResponse bitmap (bit i, LSB first in byte i // 8)."""
    return {i for i in range(min(chunk_count, len(bitmap) * 8)) if bitmap[i // 8] >> (i % 8) & 1}


def chunks_to_bitmap(chunks: Iterable[int], chunk_count: int) -> bytes:
    bitmap = bytearray((chunk_count + 7) // 8)
    for i in chunks:
        if 0 <= i < chunk_count:
            bitmap[i // 8] |= 1 << (i % 8)
    return bytes(bitmap)
