"""One multi-peer download into a partial: the I/O side of ``fabric.transport.swarm``'s pure policy.

A coordinator thread owns the plan; worker threads fetch runs of chunks,
verify and write them, and report through a queue.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from fabric.errors import AdapterNotFound, FabricError, IntegrityError, PeerUnavailable, QuotaExceeded
from fabric.rpc.status import error_from_rpc
from fabric.store.manifest import Manifest
from fabric.transport import fetch_metadata, swarm, wire
from fabric.v1 import fabric_pb2

if TYPE_CHECKING:
    from fabric.transport.pull import PeerPuller

log = logging.getLogger(__name__)

#: a chunk that fails verification is asked for again this many times per peer before moving on
CORRUPT_RETRIES_PER_PEER = 2
#: seconds for a manifest call; a dead peer answers UNAVAILABLE long before this
MANIFEST_TIMEOUT_S = 10.0
#: a peer that sends nothing for this long is cancelled and the pull moves on (a slow peer that keeps sending is fine)
STALL_TIMEOUT_S = 10.0
#: seconds for an Availability call
AVAILABILITY_TIMEOUT_S = 5.0
#: how often a pull asks a peer that holds part of the adapter what it has now
POLL_S = 0.5
#: a peer whose answers bring nothing this pull needs is asked half as often each time, down to once per this
POLL_MAX_S = 2.0
#: the coordinator's tick when no worker reports (stall checks, polls)
TICK_S = 0.1
#: seconds before asking again a peer that refused a stream as busy (RESOURCE_EXHAUSTED)
BUSY_BACKOFF_S = 0.5
#: threads of one pull at most (fetches beyond wait for a free one)
MAX_PULL_THREADS = 64
#: a directory: every pull writes a JSON trace of its requests there (scripts/bench_swarm.py reads them)
TRACE_ENV = "FABRIC_PULL_TRACE"


@dataclass
class PullStats:
    """What one pull did: what it moved and from whom (for logs, tests and the Promote reply)."""

    digest: str = ""
    bytes_transferred: int = 0
    resumed_from: int = 0
    source_peers: list[str] = field(default_factory=list)
    corrupt_chunks: int = 0
    failovers: int = 0  # peers dropped while chunks were still missing
    shared: bool = False  # this caller joined a download another caller started
    endgame_requests: int = 0  # requests that duplicated a slow one near the end
    pull_seconds: float = 0.0
    peer_bytes: dict[str, int] = field(default_factory=dict)  # verified bytes received, by source peer (metrics)


class _Active:
    """One outstanding Fetch: the call (once started), when it last delivered, and why it was cut."""

    def __init__(self) -> None:
        self.call = None
        self.last: float | None = None  # None until the call starts (it may wait for the download limit)
        self.cancelled = False
        self.stalled = False
        self._lock = threading.Lock()

    def attach(self, call) -> None:
        with self._lock:
            self.call = call
            self.last = time.monotonic()
            if self.cancelled:
                call.cancel()

    def feed(self) -> None:
        self.last = time.monotonic()

    def cancel(self, stalled: bool = False) -> None:
        with self._lock:
            self.stalled = self.stalled or stalled
            self.cancelled = True
            if self.call is not None:
                self.call.cancel()


class SwarmPull:
    """One multi-peer download into a partial: a coordinator (the calling thread) and workers.

    Only the coordinator touches the plan; workers fetch, verify and write
    chunks and report through a queue. The stall watchdog is the
    coordinator's clock: a call that delivers nothing for ``stall_timeout``
    seconds is cancelled and its peer dropped (a deadline would cut slow,
    healthy peers).
    """

    def __init__(self, puller: PeerPuller, manifest: Manifest, partial, peers: list[str], stats: PullStats) -> None:
        self.puller = puller
        self.manifest = manifest
        self.partial = partial
        self.stats = stats
        self.weights = manifest.weights
        self.done: set[int] = set(partial.verified_chunks)  # workers add to it (set.add is atomic)
        self.plan = swarm.new_plan(self.weights.chunk_count, self.done, peers)
        self.max_run = swarm.run_length(self.weights.chunk_size, self.weights.chunk_count, len(peers), puller.window)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[int, _Active] = {}
        self.polling: set[str] = set()
        self.last_poll: dict[str, float] = {}
        self.poll_gap: dict[str, float] = {}  # seconds between polls of a peer (POLL_S, backed off while it brings nothing)
        self.failures: dict[str, str] = {}
        self.refused: dict[str, tuple[str, str]] = {}  # peer -> (kind, why) of its last refusal (missing, busy): named if the pull gives up
        self.corrupt: dict[str, int] = {}
        self.delivered: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self.trace: list[list] | None = [] if os.environ.get(TRACE_ENV) else None
        self.t0 = time.monotonic()
        self._by_host_port = {_host_port(address): address for address in self.plan.peers}  # to place hints
        workers = len(peers) * puller.window + len(peers)
        self.pool = ThreadPoolExecutor(max_workers=min(MAX_PULL_THREADS, workers), thread_name_prefix="pull")

    # ------------------------------------------------------------ coordinator

    def run(self) -> None:
        plan = self.plan
        source = next(iter(plan.peers))
        swarm.set_holding(plan, source, (), complete=True)
        last_progress = time.monotonic()
        try:
            while plan.needed:
                now = time.monotonic()
                self._poll_due(now)
                for request in swarm.plan_requests(plan, now, self.puller.window, self.max_run):
                    self._start(request)
                for request in swarm.redundant(plan):
                    self.active[request.id].cancel()
                self._watch_stalls(now)
                if not plan.outstanding and not self.polling:
                    if not swarm.live_peers(plan):
                        raise self._stopped()
                    if now - last_progress > self.puller.stall_timeout:
                        # The peers' own refusals (busy, no longer holding it) say more than the silence does.
                        raise self._stopped("" if self.refused else f"no live peer announced the missing chunks for {self.puller.stall_timeout:g}s")
                try:
                    event = self.events.get(timeout=TICK_S)
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
            self.stats.source_peers = [p for p in plan.peers if self.delivered.get(p)]
            if self.trace is not None:
                self._write_trace()

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
        reasons = [f"{p}: {msg}" for p, msg in self.failures.items()]
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
        request.accept = swarm.substitutes(self.plan, request)
        handle = self.active[request.id] = _Active()
        if self.trace is not None:
            self.trace.append([time.monotonic() - self.t0, "start", request.peer, request.chunks])
        if request.endgame:
            self.stats.endgame_requests += 1
        self.pool.submit(self._fetch, request, handle)

    def _poll_due(self, now: float) -> None:
        for peer in swarm.live_peers(self.plan):
            address = peer.address
            if peer.complete or address in self.polling or now - self.last_poll.get(address, -POLL_S) < self.poll_gap.get(address, POLL_S):
                continue
            self.polling.add(address)
            self.pool.submit(self._poll, address)

    def _watch_stalls(self, now: float) -> None:
        for handle in self.active.values():
            if handle.last is not None and not handle.cancelled and now - handle.last > self.puller.stall_timeout:
                handle.cancel(stalled=True)

    def _handle(self, event: tuple, now: float) -> bool:
        """Apply one worker report to the plan; True when a chunk was verified."""
        kind, subject, detail = event
        plan = self.plan
        if kind == "chunk":
            if self.trace is not None:
                self.trace.append([now - self.t0, "chunk", subject.peer, [detail]])
            swarm.chunk_verified(plan, detail)
            self.refused.pop(subject.peer, None)  # it serves again: an earlier refusal explains nothing now
            return True
        if kind == "picked":
            swarm.retarget(plan, subject, detail)
            return False
        if kind == "dup":
            if self.trace is not None:
                self.trace.append([now - self.t0, "dup", subject.peer, [detail]])
            return False
        if kind in ("poll", "held", "hint") and self.trace is not None:
            self.trace.append([now - self.t0, kind, subject, []])
        if kind == "poll":
            self.polling.discard(subject)
            self.last_poll[subject] = now
            view = plan.peers[subject]
            if not view.dead:
                have, complete = detail
                before = view.have
                swarm.set_holding(plan, subject, have, complete)
                useful = complete or bool((view.have - before) & plan.needed)
                self.poll_gap[subject] = POLL_S if useful else min(POLL_MAX_S, 2 * self.poll_gap.get(subject, POLL_S))
            return False
        if kind in ("held", "hint"):  # a Fetch's trailer, or a peer's request to us, said what it holds: a free poll
            self.last_poll[subject] = now
            if not plan.peers[subject].dead and not plan.peers[subject].complete:
                have, complete = detail
                swarm.set_holding(plan, subject, have, complete)
            return False
        if kind == "poll-failed":
            self.polling.discard(subject)
            self.last_poll[subject] = now
            self._drop(subject, str(detail))
            return False
        request: swarm.Request = subject
        if self.trace is not None:
            self.trace.append([now - self.t0, kind, request.peer, request.chunks])
        self.active.pop(request.id, None)
        swarm.finish(plan, request, now if kind == "done" else None)
        peer = request.peer
        if kind == "corrupt":
            self.stats.corrupt_chunks += 1
            self.corrupt[peer] = self.corrupt.get(peer, 0) + 1
            log.warning("corrupt chunk from %s: %s", peer, detail)
            if self.corrupt[peer] > CORRUPT_RETRIES_PER_PEER:
                self._drop(peer, f"kept sending corrupt bytes ({detail})")
        elif kind == "missing":
            # It announced chunks it no longer has (or never had): ask it again after its next announcement.
            if self.refused.get(peer, ("",))[0] != "missing":  # its first refusal says most (it held the whole adapter then)
                what = f"no longer holds {self.manifest.adapter_id!r} (NOT_FOUND): it was unstaged or lost there" if plan.peers[peer].complete else (
                    f"no longer serves chunks of {self.manifest.adapter_id!r} it announced (NOT_FOUND)")
                self.refused[peer] = ("missing", f"{what} ({detail})")
            swarm.forget_chunks(plan, peer, [c for c in request.chunks if c in plan.needed])
            self.last_poll[peer] = now - POLL_S / 2
        elif kind == "busy":  # it limits streams per peer: back off, ask the others meanwhile
            self.refused[peer] = ("busy", f"refused the stream as busy (RESOURCE_EXHAUSTED): {detail}")
            plan.peers[peer].resume_at = now + BUSY_BACKOFF_S
        elif kind == "broken":
            log.warning("fetch from %s failed: %s", peer, detail)
            self._drop(peer, str(detail))
        elif kind == "fatal":
            raise detail
        return False

    def _drop(self, peer: str, why: str) -> None:
        view = self.plan.peers[peer]
        if view.dead:
            return
        swarm.mark_dead(self.plan, peer)
        self.failures[peer] = why
        if self.plan.needed:
            self.stats.failovers += 1
        for request in self.plan.outstanding.values():
            if request.peer == peer and request.id in self.active:
                self.active[request.id].cancel()

    # ------------------------------------------------------------ workers

    def _poll(self, peer: str) -> None:
        try:
            have, complete, count = self.puller.holding(peer, self.manifest.digest)
            if count and count != self.weights.chunk_count:
                raise IntegrityError(f"{peer} announces {count} chunks of {self.manifest.digest}, the manifest has {self.weights.chunk_count}")
        except FabricError as exc:
            self.events.put(("poll-failed", peer, exc))
        except BaseException as exc:  # never leave the coordinator waiting on a poll
            self.events.put(("poll-failed", peer, PeerUnavailable(f"{peer}: {exc!r}")))
        else:
            self.events.put(("poll", peer, (have, complete)))

    def _count(self, peer: str, moved: int) -> None:
        with self._count_lock:
            self.stats.bytes_transferred += moved
            self.delivered[peer] = self.delivered.get(peer, 0) + moved
            self.stats.peer_bytes[peer] = self.stats.peer_bytes.get(peer, 0) + moved

    def _fetch(self, request: swarm.Request, handle: _Active) -> None:
        try:
            self._fetch_run(request, handle)
        except _Refused as exc:
            self.events.put((exc.kind, request, exc.error))
        except BaseException as exc:  # a local failure (disk full, store closed): ends the pull
            self.events.put(("fatal", request, exc))
        else:
            self.events.put(("done", request, None))

    def _fetch_run(self, request: swarm.Request, handle: _Active) -> None:
        weights, peer = self.weights, request.peer
        offset = request.chunks[0] * weights.chunk_size
        end = min(weights.size, (request.chunks[-1] + 1) * weights.chunk_size)
        if handle.cancelled:
            raise _Refused("cancelled", None)
        if self.puller.download_limit is not None:
            self.puller.download_limit.acquire(end - offset)
        fetch = wire.fetch_stub(self.puller.channels.get(peer))
        accept = swarm.chunks_to_bitmap(request.accept, weights.chunk_count) if request.accept else b""
        request_pb = fabric_pb2.FetchRequest(digest=self.manifest.digest, file=weights.name, offset=offset, length=end - offset, accept_bitmap=accept)
        holding = fetch_metadata.holder(self.puller.listen_port, self.partial.verified_bitmap) if self.puller.listen_port else ()
        call = fetch(request_pb, metadata=holding)  # what we hold rides on the request: the peer need not poll us
        handle.attach(call)
        expected = request.chunks
        position = 0
        try:
            if request.accept:
                picked = fetch_metadata.picked_chunks(call.initial_metadata())
                if picked is not None:
                    expected = picked
                    self.events.put(("picked", request, picked))
            for got, data in call:
                handle.feed()
                self._count(peer, len(data))
                index, rest = divmod(got, weights.chunk_size)
                exact = position < len(expected) and index == expected[position]
                if rest or position >= len(expected) or not (exact or index in request.accept):
                    want = expected[position] * weights.chunk_size if position < len(expected) else end
                    raise IntegrityError(f"{peer} sent offset {got}, expected {want}")
                position += 1
                if index in self.done:  # a substitute that arrived by another route meanwhile
                    self.events.put(("dup", request, index))
                    continue
                self.partial.write_chunk(index, data)  # verifies first; IntegrityError = corrupt
                self.done.add(index)
                self.events.put(("chunk", request, index))
                if not request.accept and all(c in self.done for c in expected[position:]):
                    break  # the rest came from another copy (endgame)
        except IntegrityError as exc:  # a bad chunk, a misplaced one, or a malformed message
            raise _Refused("corrupt", exc) from None
        except grpc.RpcError as exc:
            if handle.stalled:
                raise _Refused("broken", PeerUnavailable(f"{peer} sent nothing for {self.puller.stall_timeout:g}s: treated as stalled")) from None
            if handle.cancelled:
                raise _Refused("cancelled", None) from None
            error = error_from_rpc(exc, peer=peer)
            kind = "missing" if isinstance(error, AdapterNotFound) else "busy" if isinstance(error, QuotaExceeded) else "broken"
            raise _Refused(kind, error) from None
        finally:
            call.cancel()  # no-op when the stream ended; stops the peer's sending when we left early
        self._report_holding(peer, call)
        if request.accept and position and not handle.cancelled:
            return  # it may send other chunks than those asked for, and fewer: what is still needed is asked again
        if not all(c in self.done for c in expected):
            if handle.cancelled:
                raise _Refused("cancelled", None)
            raise _Refused("broken", PeerUnavailable(f"{peer} ended the stream at chunk {expected[position] if position < len(expected) else end}"))

    def hint(self, host: str, port: int, bitmap: bytes) -> None:
        """A peer fetching from this node said what it holds (``fetch_metadata.holder``): as good as a poll of it (any thread)."""
        address = self._by_host_port.get((host, port))
        if address is not None:
            self.events.put(("hint", address, (swarm.bitmap_to_chunks(bitmap, self.weights.chunk_count), False)))

    def _report_holding(self, peer: str, call) -> None:
        """Pass on what a finished stream's trailer says its peer holds (``fetch_metadata.holding``)."""
        try:
            bitmap, complete = fetch_metadata.holding(call.trailing_metadata())
        except grpc.RpcError:
            return
        if complete:
            self.events.put(("held", peer, ((), True)))
        elif bitmap is not None:
            self.events.put(("held", peer, (swarm.bitmap_to_chunks(bitmap, self.weights.chunk_count), False)))


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host[1:-1] if host.startswith("[") else host), int(port) if port.isdigit() else -1


class _Refused(Exception):
    """A fetch that ended without all its chunks: ``kind`` says what the coordinator does about it."""

    def __init__(self, kind: str, error: FabricError | None) -> None:
        self.kind, self.error = kind, error
