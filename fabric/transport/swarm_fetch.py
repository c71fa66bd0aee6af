"""The worker side of one swarm download: Fetch streams and Availability polls, run on pool threads.

Workers verify and write chunks into the partial and report what happened as
events (``adapter_fabric.transport.swarm_events``); only the coordinator
(``adapter_fabric.transport.swarm_pull``) touches the plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from adapter_fabric.errors import AdapterNotFound, FabricError, IntegrityError, PeerUnavailable, QuotaExceeded
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport import fetch_metadata, peer_calls, swarm
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannelFailed
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
    FetchFailed,
    FetchMissing,
    HoldingReported,
    Polled,
    PollFailed,
    SwarmEvent,
)
from adapter_fabric.v1 import fabric_pb2

__all__ = ["FetchHandle", "SwarmWorkers"]


class FetchHandle:
    """One outstanding Fetch: the call (once started), when it last delivered, and why it was cut."""

    def __init__(self) -> None:
        self.call = None
        self.last: float | None = None  # None until the call starts (it may wait for the download limit)
        self.cancelled = False
        self.stalled = False
        self._lock = threading.Lock()

    def attach(self, call: Any) -> None:
        """The call started: the stall clock runs from now, and a cancel that came first takes effect."""
        with self._lock:
            self.call = call
            self.last = time.monotonic()
            if self.cancelled:
                call.cancel()

    def feed(self) -> None:
        """The call delivered: restart its stall clock."""
        self.last = time.monotonic()

    def cancel(self, stalled: bool = False) -> None:
        """Cut the call (now, or as soon as it starts); ``stalled`` says the watchdog cut it."""
        with self._lock:
            self.stalled = self.stalled or stalled
            self.cancelled = True
            if self.call is not None:
                self.call.cancel()


class SwarmWorkers:
    """Fetches and polls for one download; each outcome goes to ``report`` as one event (any thread).

    ``done`` is shared with the coordinator: workers add each verified chunk
    (``set.add`` is atomic), so a substitute that arrives by another route
    is not written twice. ``each_chunk``: report every verified chunk as it lands (a swarm: other requests and
    peers depend on it at once); False for a pull from one peer, whose coordinator counts a request's chunks from
    ``done`` when it ends (a wake of that thread per chunk, taking the GIL from the worker mid-chunk, cost a fifth of
    such a pull's CPU; issue 34).
    """

    def __init__(
        self,
        manifest: Manifest,
        partial: Any,
        done: set[int],
        stats: PullStats,
        report: Callable[[SwarmEvent], None],
        *,
        settings: PullSettings,
        channels: PeerChannels,
        download_limit: TokenBucket | None,
        holding: peer_calls.HoldingCall,
        each_chunk: bool = True,
    ) -> None:
        self.each_chunk = each_chunk
        self.manifest = manifest
        self.weights = manifest.weights
        self.partial = partial
        self.done = done
        self.stats = stats
        self.report = report
        self.settings = settings
        self.channels = channels
        self.download_limit = download_limit
        self.holding = holding
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------ polls

    def poll(self, peer: str) -> None:
        """Ask ``peer`` what it holds; reports Polled, or PollFailed (never raises: the coordinator waits on it)."""
        try:
            have, complete, count = self.holding(peer, self.manifest.digest)
            if count and count != self.weights.chunk_count:
                raise IntegrityError(f"{peer} announces {count} chunks of {self.manifest.digest}, the manifest has {self.weights.chunk_count}")
        except FabricError as exc:
            self.report(PollFailed(peer, exc))
        except BaseException as exc:  # never leave the coordinator waiting on a poll
            self.report(PollFailed(peer, PeerUnavailable(f"{peer}: {exc!r}")))
        else:
            self.report(Polled(peer, have, complete))

    # ------------------------------------------------------------ fetches

    def fetch(self, request: swarm.Request, handle: FetchHandle) -> None:
        """Run one request's stream; reports how it ended as one FetchEnded event (never raises)."""
        try:
            self._fetch_run(request, handle)
        except _Ended as exc:
            self.report(exc.event)
        except BaseException as exc:  # a local failure (disk full, store closed): ends the pull
            self.report(FetchFailed(request, exc))
        else:
            self.report(FetchDone(request))

    def _count(self, peer: str, moved: int) -> None:
        with self._count_lock:
            self.stats.bytes_transferred += moved
            self.stats.peer_bytes[peer] = self.stats.peer_bytes.get(peer, 0) + moved

    def _fetch_run(self, request: swarm.Request, handle: FetchHandle) -> None:
        weights, peer = self.weights, request.peer
        offset = request.chunks[0] * weights.chunk_size
        end = min(weights.size, (request.chunks[-1] + 1) * weights.chunk_size)
        if handle.cancelled:
            raise _Ended(FetchCancelled(request))
        if self.download_limit is not None:
            self.download_limit.acquire(end - offset)
        accept = swarm.chunks_to_bitmap(request.accept, weights.chunk_count) if request.accept else b""
        request_pb = fabric_pb2.FetchRequest(digest=self.manifest.digest, file=weights.name, offset=offset, length=end - offset, accept_bitmap=accept)
        listen_port = self.settings.listen_port
        holder = (listen_port, self.partial.verified_bitmap) if listen_port else None
        # what we hold rides on the request: the peer need not poll us
        call = peer_calls.fetch(self.channels, peer, request_pb, holder, weights.chunk_size, beside=request.beside)
        handle.attach(call)
        expected = request.chunks
        position = 0
        try:
            if request.accept:
                said = call.initial_metadata()
                picked = fetch_metadata.picked_chunks(said)
                if picked is not None:
                    expected = picked
                    self.report(ChunksPicked(request, picked, fetch_metadata.other_pullers(said)))
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
                    self.report(DuplicateChunk(request, index))
                    continue
                self.partial.write_chunk(index, data)  # verifies first; IntegrityError = corrupt
                self.done.add(index)
                if self.each_chunk:
                    self.report(ChunkVerified(request, index))
                if not request.accept and position < len(expected) and all(c in self.done for c in expected[position:]):
                    break  # the rest came from another copy (endgame); after its last chunk a stream reads its END (the peer's holdings, a kept connection)
        except IntegrityError as exc:  # a bad chunk, a misplaced one, or a malformed message
            raise _Ended(FetchCorrupt(request, exc)) from None
        except (grpc.RpcError, DataChannelFailed) as exc:
            if handle.stalled:
                stalled = PeerUnavailable(f"{peer} sent nothing for {self.settings.stall_timeout:g}s: treated as stalled")
                raise _Ended(FetchBroken(request, stalled)) from None
            if handle.cancelled:
                raise _Ended(FetchCancelled(request)) from None
            error = exc.error if isinstance(exc, DataChannelFailed) else error_from_rpc(exc, peer=peer)
            raise _Ended(_refusal(request, error)) from None
        finally:
            call.cancel()  # no-op when the stream ended; stops the peer's sending when we left early
        self._report_holding(peer, call)
        if request.accept and position and not handle.cancelled:
            return  # it may send other chunks than those asked for, and fewer: what is still needed is asked again
        if not all(c in self.done for c in expected):
            if handle.cancelled:
                raise _Ended(FetchCancelled(request))
            short = PeerUnavailable(f"{peer} ended the stream at chunk {expected[position] if position < len(expected) else end}")
            raise _Ended(FetchBroken(request, short))

    def _report_holding(self, peer: str, call: Any) -> None:
        """Pass on what a finished stream's trailer says its peer holds (``fetch_metadata.holding``)."""
        try:
            trailer = call.trailing_metadata()
        except grpc.RpcError:
            return
        self.channels.learn(peer, trailer)  # a gRPC stream's trailer announces the peer's data channel
        bitmap, complete = fetch_metadata.holding(trailer)
        if complete:
            self.report(HoldingReported(peer, (), True))
        elif bitmap is not None:
            self.report(HoldingReported(peer, swarm.bitmap_to_chunks(bitmap, self.weights.chunk_count), False))


def _refusal(request: swarm.Request, error: FabricError) -> FetchMissing | FetchBusy | FetchBroken:
    """The event for a peer's error status: not found, busy, or broken."""
    if isinstance(error, AdapterNotFound):
        return FetchMissing(request, error)
    if isinstance(error, QuotaExceeded):
        return FetchBusy(request, error)
    return FetchBroken(request, error)


class _Ended(Exception):
    """A fetch that ended without all its chunks: ``event`` says how, for the coordinator."""

    def __init__(self, event: FetchCancelled | FetchCorrupt | FetchMissing | FetchBusy | FetchBroken) -> None:
        super().__init__(event)
        self.event = event
