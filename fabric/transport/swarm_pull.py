"""One multi-peer download into a partial: the I/O side of ``adapter_fabric.transport.swarm``'s pure policy.

A coordinator thread owns the plan; worker threads (``adapter_fabric.transport.swarm_fetch``)
fetch runs of chunks, verify and write them, and report through a queue, one
typed event (``adapter_fabric.transport.swarm_events``) per thing that happened; a pull from one peer
reports its chunks when each request ends, not each as it lands (``SwarmWorkers.each_chunk``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adapter_fabric.errors import PEER_STREAMS_BOUND, AdapterNotFound, PeerUnavailable
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport import peer_calls, swarm
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.pace import pace_for
from adapter_fabric.transport.pull_values import PullSettings, PullStats
from adapter_fabric.transport.rate import TokenBucket
from adapter_fabric.transport.swarm_events import (
    ChunksPicked,
    ChunkVerified,
    DuplicateChunk,
    FetchBroken,
    FetchBusy,
    FetchCancelled,
    FetchCorrupt,
    FetchDone,
    FetchEnded,
    FetchFailed,
    FetchMissing,
    HoldingHinted,
    HoldingNews,
    HoldingReported,
    Polled,
    PollFailed,
    SwarmEvent,
)
from adapter_fabric.transport.swarm_fetch import FetchHandle, SwarmWorkers

__all__ = ["SwarmPull"]

log = logging.getLogger(__name__)

#: a chunk that fails verification is asked for again this many times per peer before moving on
CORRUPT_RETRIES_PER_PEER = 2
#: how often a pull asks a peer that holds part of the adapter what it has now
POLL_S = 0.5
#: a peer whose answers bring nothing this pull needs is asked half as often each time, down to once per this
POLL_MAX_S = 2.0
#: the coordinator's tick when no worker reports (stall checks, polls)
TICK_S = 0.1
#: a dropped peer's stream still running is cut after this long without delivering (its chunks then go to others)
DROPPED_PEER_STALL_S = 3.0
#: why a dropped peer failed, then why its remaining streams ended: at most this many distinct reasons
MAX_REASONS_PER_PEER = 2
#: seconds before asking again a peer that refused a stream as busy (RESOURCE_EXHAUSTED)
BUSY_BACKOFF_S = 0.5
#: Availability polls of one pull in flight at most: they share its threads with its fetches, and a poll to a member that
#: does not answer holds its thread for peer_calls.AVAILABILITY_TIMEOUT_S (a pull asks up to swarm.SWARM_PEERS peers)
MAX_POLLING = 16
#: threads of one pull at most (fetches beyond wait for a free one)
MAX_PULL_THREADS = 64
#: a directory: every pull writes a JSON trace of its requests there (scripts/bench_swarm.py reads them)
TRACE_ENV = "FABRIC_PULL_TRACE"


class SwarmPull:
    """One multi-peer download into a partial: a coordinator (the calling thread) and workers.

    Only the coordinator touches the plan; workers fetch, verify and write
    chunks and report through a queue. The stall watchdog is the
    coordinator's clock: a call that delivers nothing for
    ``settings.stall_timeout`` seconds is cancelled and its peer dropped (a
    deadline would cut slow, healthy peers). ``peers[0]`` served the
    manifest, so it holds every chunk; the others are polled with ``holding``.
    """

    def __init__(
        self,
        manifest: Manifest,
        partial: Any,
        peers: list[str],
        stats: PullStats,
        *,
        settings: PullSettings,
        channels: PeerChannels,
        download_limit: TokenBucket | None,
        holding: peer_calls.HoldingCall,
        complete: Collection[str] = (),
    ) -> None:
        """``complete``: peers known to hold every chunk (a lookup asked them): never polled."""
        self.manifest = manifest
        self.complete = set(complete)
        self.partial = partial
        self.stats = stats
        self.settings = settings
        self.weights = manifest.weights
        self.done: set[int] = set(partial.verified_chunks)  # workers add to it (set.add is atomic)
        self.plan = swarm.new_plan(self.weights.chunk_count, self.done, peers)
        self.channels = channels
        sources = list(self.plan.peers)
        # a lone source that refused a stream beside another of ours lately is asked one at a time
        several = channels.takes_streams_beside(sources[0])
        self.pace = pace_for(self.weights.chunk_size, self.weights.chunk_count, len(sources), settings.window, several)
        self.events: queue.SimpleQueue[SwarmEvent] = queue.SimpleQueue()
        self.active: dict[int, FetchHandle] = {}
        self.polling: set[str] = set()
        self.last_poll: dict[str, float] = {}
        self.poll_gap: dict[str, float] = {}  # seconds between polls of a peer (POLL_S, backed off while it brings nothing)
        self.failures: dict[str, list[str]] = {}  # peer -> why it was dropped (then why its remaining streams ended)
        self.refused: dict[str, tuple[str, str]] = {}  # peer -> (kind, why) of its last refusal (missing, busy): named if the pull gives up
        self.held_whole: set[str] = set()  # peers that held every chunk during this pull (a refusal's wording)
        self.corrupt: dict[str, int] = {}
        self.trace: list[list] | None = [] if os.environ.get(TRACE_ENV) else None
        self.t0 = time.monotonic()
        self._by_host_port = {_host_port(address): address for address in self.plan.peers}  # to place hints
        self.workers = SwarmWorkers(
            manifest, partial, self.done, stats, self.events.put,
            settings=settings, channels=channels, download_limit=download_limit, holding=holding, each_chunk=len(self.plan.peers) > 1,
        )
        workers = len(peers) * max(self.pace.swarm_window, self.pace.lone_window) + len(peers)
        self.pool = ThreadPoolExecutor(max_workers=min(MAX_PULL_THREADS, workers), thread_name_prefix="pull")
        # One handler per kind of event; each returns True when a chunk was verified (progress).
        self._handlers: dict[type, Callable[[Any, float], bool]] = {
            ChunkVerified: self._on_chunk,
            ChunksPicked: self._on_picked,
            DuplicateChunk: self._on_duplicate,
            Polled: self._on_polled,
            HoldingReported: self._on_announced,
            HoldingHinted: self._on_announced,
            PollFailed: self._on_poll_failed,
            FetchDone: self._on_done,
            FetchCancelled: self._on_cancelled,
            FetchCorrupt: self._on_corrupt,
            FetchMissing: self._on_missing,
            FetchBusy: self._on_busy,
            FetchBroken: self._on_broken,
            FetchFailed: self._on_failed,
        }

    # ------------------------------------------------------------ coordinator

    def run(self) -> None:
        """Download every missing chunk, or raise (AdapterNotFound, PeerUnavailable, a local error); what was verified is kept."""
        plan = self.plan
        source = next(iter(plan.peers))
        for whole in {source} | (self.complete & set(plan.peers)):
            self._hold(whole, (), complete=True)
        last_progress = time.monotonic()
        # The source serves at once; peers are first asked POLL_S in. Pullers of one rollout start together, and a
        # poll at the start found nothing (half of a 16-node rollout's polls); one already holding chunks waits POLL_S.
        for address in plan.peers:
            self.last_poll.setdefault(address, last_progress)
        stall_timeout = self.settings.stall_timeout
        try:
            while plan.needed:
                now = time.monotonic()
                self._poll_due(now)
                for request in swarm.plan_requests(plan, now, self.pace.window, self.pace.max_run):
                    self._start(request)
                for request in swarm.redundant(plan):
                    self.active[request.id].cancel()
                self._watch_stalls(now)
                if not plan.outstanding and not self.polling:
                    if not swarm.live_peers(plan):
                        raise self._stopped()
                    if now - last_progress > stall_timeout:
                        # The peers' own refusals (busy, no longer holding it) say more than the silence does.
                        raise self._stopped("" if self.refused else f"no live peer announced the missing chunks for {stall_timeout:g}s")
                try:
                    event: SwarmEvent | None = self.events.get(timeout=TICK_S)
                except queue.Empty:
                    continue
                while event is not None:
                    if self._handle(event, time.monotonic()):
                        last_progress = time.monotonic()
                    try:
                        event = self.events.get_nowait()
                    except queue.Empty:
                        event = None
        finally:
            for handle in self.active.values():
                handle.cancel()
            self.pool.shutdown(wait=True)
            # Bytes each peer delivered are counted per peer in the stats (swarm_fetch): those that sent any are the sources.
            self.stats.source_peers = [p for p in plan.peers if self.stats.peer_bytes.get(p)]
            if self.trace is not None:
                self._write_trace()

    def hint(self, host: str, port: int, bitmap: bytes) -> None:
        """A peer fetching from this node said what it holds (``fetch_metadata.holder``): as good as a poll of it (any thread)."""
        address = self._by_host_port.get((host, port))
        if address is not None:
            self.events.put(HoldingHinted(address, swarm.bitmap_to_chunks(bitmap, self.weights.chunk_count), False))

    def _write_trace(self) -> None:
        """One JSON file per pull: [seconds since start, event, peer, chunks] rows, for the swarm benchmark."""
        path = os.path.join(os.environ[TRACE_ENV], f"pull-{self.manifest.digest[:12]}-{os.getpid()}-{id(self):x}.json")
        try:
            with open(path, "w") as f:
                json.dump({"peers": list(self.plan.peers), "events": self.trace}, f)
        except OSError as exc:
            log.warning("pull trace not written to %s: %s", path, exc)

    def _stopped(self, why: str = "") -> AdapterNotFound | PeerUnavailable:
        weights = self.weights
        have = sum(weights.chunk_span(i)[1] for i in self.done)
        reasons = [f"{p}: {'; then '.join(msgs)}" for p, msgs in self.failures.items()]
        reasons += [f"{p}: {msg}" for p, (_, msg) in self.refused.items() if p not in self.failures]
        reasons += [why] if why else []
        # Not found only when every peer says so: none failed otherwise, none is busy, none announces a needed chunk.
        holders = [p for p in swarm.live_peers(self.plan) if p.complete or p.have & self.plan.needed]
        gone = bool(self.refused) and all(kind == "missing" for kind, _ in self.refused.values())
        error = AdapterNotFound if gone and not self.failures and not holders else PeerUnavailable
        return error(
            f"pull of {self.manifest.adapter_id!r} stopped at {have} of {weights.size} bytes (kept for resume): "
            + ("; ".join(reasons) or "no peer held the missing chunks")
        )

    def _start(self, request: swarm.Request) -> None:
        swarm.offer(self.plan, request)
        handle = self.active[request.id] = FetchHandle()
        if self.trace is not None:
            self.trace.append([time.monotonic() - self.t0, "start", request.peer, request.chunks])
        if request.endgame:
            self.stats.endgame_requests += 1
        self.pool.submit(self.workers.fetch, request, handle)

    def _poll_due(self, now: float) -> None:
        for peer in swarm.live_peers(self.plan):
            if len(self.polling) >= MAX_POLLING:
                return  # the rest stay due, and are asked as these answer
            address = peer.address
            # A peer answering a request of ours says what it holds at the request's END: only an idle one is asked.
            if peer.complete or peer.inflight or address in self.polling or now - self.last_poll.get(address, -POLL_S) < self.poll_gap.get(address, POLL_S):
                continue
            self.polling.add(address)
            self.pool.submit(self.workers.poll, address)

    def _watch_stalls(self, now: float) -> None:
        plan = self.plan
        for request_id, handle in self.active.items():
            if handle.last is None or handle.cancelled:
                continue
            # A dropped peer's streams may finish (a draining seed), but one that falls silent is cut soon: failover waits little.
            request = plan.outstanding.get(request_id)
            if request is not None and plan.peers[request.peer].dead:
                if now - handle.last > min(DROPPED_PEER_STALL_S, self.settings.stall_timeout):
                    handle.cancel()  # why the peer was dropped is named already
            elif now - handle.last > self.settings.stall_timeout:
                handle.cancel(stalled=True)

    def _drop(self, peer: str, why: str, cut_streams: bool = False) -> None:
        """No new requests go to ``peer``; ``cut_streams`` also cancels those it is still answering (it sent corrupt bytes).

        A peer that refused a new stream may still be delivering the others: a draining seed finishes them within its
        --drain-timeout, or ends them naming why. They end on their own, and a later, different reason is kept too.
        """
        view = self.plan.peers[peer]
        if view.dead:
            reasons = self.failures.setdefault(peer, [])
            if why not in reasons and len(reasons) < MAX_REASONS_PER_PEER:
                reasons.append(why)
            return
        swarm.mark_dead(self.plan, peer)
        self.failures[peer] = [why]
        if self.plan.needed:
            self.stats.failovers += 1
        if cut_streams:
            for request in self.plan.outstanding.values():
                if request.peer == peer and request.id in self.active:
                    self.active[request.id].cancel()

    # ------------------------------------------------------------ events

    def _handle(self, event: SwarmEvent, now: float) -> bool:
        """Apply one worker report to the plan; True when a chunk was verified."""
        settled = self._settle(event, now) if isinstance(event, FetchEnded) and not self.workers.each_chunk else False
        row = event.trace_row()
        if row is not None and self.trace is not None:
            self.trace.append([now - self.t0, *row])
        return self._handlers[type(event)](event, now) or settled

    def _on_chunk(self, event: ChunkVerified, now: float) -> bool:
        swarm.chunk_verified(self.plan, event.chunk, event.request)
        self.refused.pop(event.request.peer, None)  # it serves again: an earlier refusal explains nothing now
        return True

    def _settle(self, event: FetchEnded, now: float) -> bool:
        """A request of a pull from one peer ended: the chunks it verified (``done``), handled as a swarm's worker reports
        each, before the ending frees the rest for the next request."""
        verified = [c for c in event.request.chunks if c in self.done and c in self.plan.needed]
        return any([self._handle(ChunkVerified(event.request, chunk), now) for chunk in verified])  # a list: every one handled

    def _on_picked(self, event: ChunksPicked, now: float) -> bool:
        swarm.retarget(self.plan, event.request, event.chunks)
        self.pace.heard(self.plan, event.others)
        return False

    def _on_duplicate(self, event: DuplicateChunk, now: float) -> bool:
        return False  # traced only

    def _on_polled(self, event: Polled, now: float) -> bool:
        peer = event.peer
        self.polling.discard(peer)
        self.last_poll[peer] = now
        view = self.plan.peers[peer]
        if not view.dead:
            before = view.have
            self._hold(peer, event.have, event.complete)
            useful = event.complete or bool((view.have - before) & self.plan.needed)
            self.poll_gap[peer] = POLL_S if useful else min(POLL_MAX_S, 2 * self.poll_gap.get(peer, POLL_S))
        return False

    def _on_announced(self, event: HoldingNews, now: float) -> bool:
        """A Fetch's trailer, or a peer's request to us, said what it holds: a free poll."""
        self.last_poll[event.peer] = now
        view = self.plan.peers[event.peer]
        if not view.dead and not view.complete:
            self._hold(event.peer, event.have, event.complete)
        return False

    def _hold(self, peer: str, have: Collection[int], complete: bool) -> None:
        """Record what ``peer`` holds in the plan; one that held every chunk is remembered so (a refusal's wording)."""
        swarm.set_holding(self.plan, peer, have, complete)
        if complete:
            self.held_whole.add(peer)

    def _on_poll_failed(self, event: PollFailed, now: float) -> bool:
        self.polling.discard(event.peer)
        self.last_poll[event.peer] = now
        self._drop(event.peer, str(event.error))
        return False

    def _finish(self, event: FetchEnded, finished: float | None = None) -> str:
        """Every ended request: no longer active, its unverified chunks free again; its peer is returned."""
        self.active.pop(event.request.id, None)
        swarm.finish(self.plan, event.request, finished)
        return event.request.peer

    def _on_done(self, event: FetchDone, now: float) -> bool:
        self._finish(event, now)  # its duration feeds the endgame's clock
        return False

    def _on_cancelled(self, event: FetchCancelled, now: float) -> bool:
        self._finish(event)
        return False

    def _on_corrupt(self, event: FetchCorrupt, now: float) -> bool:
        peer = self._finish(event)
        self.stats.corrupt_chunks += 1
        self.corrupt[peer] = self.corrupt.get(peer, 0) + 1
        log.warning("corrupt chunk from %s: %s", peer, event.error)
        if self.corrupt[peer] > CORRUPT_RETRIES_PER_PEER:
            self._drop(peer, f"kept sending corrupt bytes ({event.error})", cut_streams=True)
        return False

    def _on_missing(self, event: FetchMissing, now: float) -> bool:
        # It announced chunks it no longer has (or never had): ask it again after its next announcement.
        peer, plan = self._finish(event), self.plan
        if self.refused.get(peer, ("",))[0] != "missing":  # its first refusal says most (it held the whole adapter then)
            # held_whole, not complete: another stream's refusal may have marked it partial already (window > 1)
            what = f"no longer holds {self.manifest.adapter_id!r} (NOT_FOUND): it was unstaged or lost there" if peer in self.held_whole else (
                f"no longer serves chunks of {self.manifest.adapter_id!r} it announced (NOT_FOUND)")
            self.refused[peer] = ("missing", f"{what} ({event.error})")
        swarm.forget_chunks(plan, peer, [c for c in event.request.chunks if c in plan.needed])
        self.last_poll[peer] = now - POLL_S / 2
        return False

    def _on_busy(self, event: FetchBusy, now: float) -> bool:
        peer = self._finish(event)
        view = self.plan.peers[peer]
        # its per-peer limit (or, from an older node naming no bound, taken for it): it serves the streams of ours it took
        if view.inflight and getattr(event.error, "bound", "") in ("", PEER_STREAMS_BOUND):
            view.cap = view.inflight
            self.channels.refused_beside(peer)
            return False
        # Its limit is in use by others, or a seed sends us to the nodes its first copies went to: back off, ask the others.
        self.refused[peer] = ("busy", f"refused the stream as busy (RESOURCE_EXHAUSTED): {event.error}")
        self.plan.peers[peer].resume_at = now + BUSY_BACKOFF_S
        return False

    def _on_broken(self, event: FetchBroken, now: float) -> bool:
        peer = self._finish(event)
        log.warning("fetch from %s failed: %s", peer, event.error)
        self._drop(peer, str(event.error))
        return False

    def _on_failed(self, event: FetchFailed, now: float) -> bool:
        self._finish(event)
        raise event.error


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host[1:-1] if host.startswith("[") else host), int(port) if port.isdigit() else -1
