"""A pull from one peer: its worker reports a request's chunks when the request ends, not each as it lands
(``SwarmWorkers.each_chunk``), and the coordinator still counts them as progress.

Beside many members that hold nothing, its polls of them are bounded (``MAX_POLLING`` in flight).

The coordinator (``SwarmPull``) is the part under test; the worker's fetch is replaced by a script of what a peer did
(its chunks verified and written into the real partial, then how the request ended), so the order of events is exact.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from adapter_fabric.errors import FIRST_COPIES_BOUND, PEER_STREAMS_BOUND, IntegrityError, QuotaExceeded
from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport import peer_calls, swarm
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.pull_values import PullSettings, PullStats
from adapter_fabric.transport.swarm_events import ChunksPicked, ChunkVerified, FetchBusy, FetchCorrupt, FetchDone, FetchFailed
from adapter_fabric.transport.swarm_fetch import FetchHandle
from adapter_fabric.transport.swarm_pull import MAX_POLLING, TRACE_ENV, SwarmPull

PEER = "127.0.0.1:1"
STALL_S = 1.0  # above the busy back-off (0.5 s), which a pull waits out without progress


@pytest.fixture
def staged(tmp_path) -> tuple[AdapterStore, object, bytes]:
    """A 1 MiB adapter staged in 64 KiB chunks (17 with the header), its manifest and its weights' bytes."""
    seed = AdapterStore(tmp_path / "seed", chunk_size=64 << 10)
    manifest = seed.stage(make_adapter(tmp_path / "adapter", size_mib=1, hidden=1024, rank=64), "one/peer")
    blob = Path(seed.verified_weights(manifest)).read_bytes()
    return AdapterStore(tmp_path / "store", chunk_size=64 << 10), manifest, blob


def test_a_request_that_verified_chunks_counts_as_progress_when_it_ends(staged, tmp_path, monkeypatch) -> None:
    """The peer sends half of the first request, then a corrupt chunk; it refuses the retry as busy, and serves the one
    after. The refusal comes later than the stall timeout after the pull began but at once after the half: the pull
    waits out the busy back-off and completes (had the half not counted as progress, it ended as stalled)."""
    store, manifest, blob = staged
    weights = manifest.weights
    partial = store.open_partial(manifest)
    script = ["half then corrupt", "busy"]  # then every request is served whole
    reported: list[object] = []

    def fetch(request: swarm.Request, handle: FetchHandle) -> None:
        try:
            serve(request)
        except BaseException as exc:  # as the real worker does: the coordinator never waits on a fetch that failed here
            pull.events.put(FetchFailed(request, exc))

    def serve(request: swarm.Request) -> None:
        step = script.pop(0) if script else "whole"
        # the plan's first request starts at a random chunk, so it may be the file's last one alone: "half" is one at least
        half = request.chunks[: max(1, len(request.chunks) // 2)]
        chunks = half if step == "half then corrupt" else [] if step == "busy" else request.chunks
        for index in chunks:
            offset, length = weights.chunk_span(index)
            partial.write_chunk(index, blob[offset : offset + length])
            pull.done.add(index)
        if step == "half then corrupt":
            time.sleep(STALL_S + 0.1)  # the first half's chunks land; the request ends past the stall timeout
            pull.events.put(event := FetchCorrupt(request, IntegrityError("chunk failed verification")))
        elif step == "busy":
            pull.events.put(event := FetchBusy(request, QuotaExceeded("busy")))
        else:
            pull.events.put(event := FetchDone(request))
        reported.append(event)

    stats = PullStats(digest=manifest.digest)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))  # the trace: what the coordinator took as verified, and when
    pull = _scripted(manifest, partial, stats, PullSettings(stall_timeout=STALL_S, window=1), fetch)  # the script: one request at a time
    assert not pull.workers.each_chunk  # one peer: no event per chunk
    committed = _run(pull, partial)
    assert committed.digest == manifest.digest and stats.corrupt_chunks == 1
    assert [type(e).__name__ for e in reported][:3] == ["FetchCorrupt", "FetchBusy", "FetchDone"]
    assert weights.chunk_count > 16
    assert pull.trace is not None
    rows = [row[1:] for row in pull.trace]
    taken = [row[2][0] for row in rows if row[0] == "chunk"]
    assert sorted(taken) == list(range(weights.chunk_count))  # each chunk counted once, none missed
    ends = [i for i, row in enumerate(rows) if row[0] in ("corrupt", "done")]
    assert all(rows[i - 1][0] == "chunk" for i in ends)  # a request's chunks are counted as it ends, before its ending


def test_a_plan_of_two_peers_keeps_an_event_per_chunk(staged) -> None:
    """The switch only (a swarm's per-chunk events drive its endgame and holdings: tests/transport/test_swarm_counts.py)."""
    store, manifest, _ = staged
    partial = store.open_partial(manifest)
    try:
        pull = SwarmPull(
            manifest, partial, [PEER, "127.0.0.1:2"], PullStats(digest=manifest.digest), settings=PullSettings(), channels=PeerChannels(),
            download_limit=None, holding=lambda peer, digest: peer_calls.holding(PeerChannels(), peer, digest),
        )
        assert pull.workers.each_chunk
        pull.pool.shutdown()
    finally:
        partial.close()


def test_a_pull_from_one_peer_runs_two_requests_at_once_over_halves_of_the_file(staged) -> None:
    """The default window on a pull's only source is two (``swarm.window_for``): both requests are outstanding
    together (each waits here until the other has started), and they split the file evenly between them."""
    store, manifest, blob = staged
    weights = manifest.weights
    partial = store.open_partial(manifest)
    started: list[list[int]] = []
    both = threading.Barrier(2, timeout=10)

    def fetch(request: swarm.Request, handle: FetchHandle) -> None:
        try:
            started.append(list(request.chunks))
            both.wait()  # a BrokenBarrierError after 10 s: the second request never started beside the first
            for index in request.chunks:
                offset, length = weights.chunk_span(index)
                partial.write_chunk(index, blob[offset : offset + length])
                pull.done.add(index)
            pull.events.put(FetchDone(request))
        except BaseException as exc:
            pull.events.put(FetchFailed(request, exc))

    pull = _scripted(manifest, partial, PullStats(digest=manifest.digest), PullSettings(stall_timeout=STALL_S), fetch)
    assert _run(pull, partial).digest == manifest.digest
    assert sorted(started) == [list(range(9)), list(range(9, 17))]  # 17 chunks in file order: runs of 9, both at once


@pytest.mark.parametrize(("bound", "capped"), [(PEER_STREAMS_BOUND, True), ("", True), (FIRST_COPIES_BOUND, False)])
def test_a_refusal_beside_a_stream_in_flight_caps_the_peer_only_when_its_per_peer_limit_refused(staged, bound, capped) -> None:
    """The second of the two requests is refused as busy while the first is in flight. Refused by the peer's streams per
    peer (or by an older node, which names no bound: taken for that limit), the peer is asked one stream at a time, now
    and by later pulls (``refused_beside``). A seed's refusal for its first copies is not that limit: the pull backs off
    and asks two at a time again, and nothing is remembered."""
    store, manifest, blob = staged
    weights = manifest.weights
    partial = store.open_partial(manifest)
    calls: list[list[int]] = []
    lock = threading.Lock()
    refused = threading.Event()
    asked_again = threading.Event()
    overlapped: list[bool] = []  # whether a third request came while the first was in flight

    def fetch(request: swarm.Request, handle: FetchHandle) -> None:
        with lock:
            calls.append(list(request.chunks))
            n = len(calls)
        if n == 2:
            pull.events.put(FetchBusy(request, QuotaExceeded("busy", bound)))
            refused.set()
            return
        if n == 1:
            refused.wait(10)
            overlapped.append(asked_again.wait(2.0))  # the back-off is 0.5 s: an uncapped peer is asked again well within this
        elif n == 3:
            asked_again.set()
        for index in request.chunks:
            offset, length = weights.chunk_span(index)
            partial.write_chunk(index, blob[offset : offset + length])
            pull.done.add(index)
        pull.events.put(FetchDone(request))

    pull = _scripted(manifest, partial, PullStats(digest=manifest.digest), PullSettings(stall_timeout=5.0), fetch)
    assert _run(pull, partial).digest == manifest.digest
    assert (pull.plan.peers[PEER].cap == 1) is capped
    assert pull.channels.takes_streams_beside(PEER) is not capped
    assert overlapped == [not capped]  # capped, the third request waited for the first to end


def _scripted(manifest, partial, stats: PullStats, settings: PullSettings, fetch) -> SwarmPull:
    """A coordinator over the real partial from ``PEER`` alone, its worker's fetch replaced by ``fetch``."""
    pull = SwarmPull(
        manifest, partial, [PEER], stats, settings=settings, channels=PeerChannels(),
        download_limit=None, holding=lambda peer, digest: peer_calls.holding(PeerChannels(), peer, digest),
    )
    pull.workers.fetch = fetch  # type: ignore[method-assign]
    return pull


def _run(pull: SwarmPull, partial):
    """Run ``pull`` and commit what it brought; the partial is closed either way."""
    try:
        pull.run()
        return partial.commit("one/peer")
    finally:
        partial.close()


def test_a_pull_beside_many_members_polls_at_most_max_polling_of_them_at_once(staged) -> None:
    """Polls share a pull's threads with its fetches, and one to a member that does not answer holds its thread for
    seconds: beside 40 members that hold nothing (each poll answers after 0.1 s), at most MAX_POLLING are in flight,
    and every member is still asked. The holder's first request waits until they all were."""
    store, manifest, blob = staged
    weights = manifest.weights
    partial = store.open_partial(manifest)
    members = [f"127.0.0.1:{1000 + i}" for i in range(40)]
    lock, in_flight, most, asked = threading.Lock(), [0], [0], set()
    all_asked = threading.Event()

    def holding(peer: str, digest: str) -> peer_calls.Holding:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.1)
        with lock:
            in_flight[0] -= 1
            asked.add(peer)
            if len(asked) == len(members):
                all_asked.set()
        return peer_calls.Holding(set(), False, 0)

    def fetch(request: swarm.Request, handle: FetchHandle) -> None:
        all_asked.wait(10)
        for index in request.chunks:
            offset, length = weights.chunk_span(index)
            partial.write_chunk(index, blob[offset : offset + length])
            pull.done.add(index)
            pull.events.put(ChunkVerified(request, index))  # several peers: an event per chunk
        pull.events.put(FetchDone(request))

    pull = SwarmPull(
        manifest, partial, [PEER, *members], PullStats(digest=manifest.digest), settings=PullSettings(stall_timeout=30.0),
        channels=PeerChannels(), download_limit=None, holding=holding,
    )
    pull.workers.fetch = fetch  # type: ignore[method-assign]
    assert _run(pull, partial).digest == manifest.digest
    assert asked == set(members) and 1 < most[0] <= MAX_POLLING, (len(asked), most[0])


@pytest.mark.parametrize("others", [0, 3, None])
def test_a_pull_beside_idle_members_ramps_to_long_runs_only_when_the_holder_says_nobody_else_pulls(staged, others) -> None:
    """The holder's pick says how many others pull from it (``recent_pullers``): 0 ramps the runs (1, 2, 4, 8, up to one
    source's 9 of 17 chunks) on two streams; others, or an older holder that says nothing, keep a swarm's pace (one
    chunk, one request at a time)."""
    store, manifest, blob = staged
    weights = manifest.weights
    partial = store.open_partial(manifest)
    members = [f"127.0.0.1:{1000 + i}" for i in range(6)]
    runs: list[list[int]] = []
    lock, in_flight, most = threading.Lock(), [0], [0]

    def fetch(request: swarm.Request, handle: FetchHandle) -> None:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            runs.append(list(request.chunks))
        pull.events.put(ChunksPicked(request, list(request.chunks), others))
        time.sleep(0.01)  # long enough for the coordinator to plan beside it
        for index in request.chunks:
            offset, length = weights.chunk_span(index)
            partial.write_chunk(index, blob[offset : offset + length])
            pull.done.add(index)
            pull.events.put(ChunkVerified(request, index))
        with lock:
            in_flight[0] -= 1
        pull.events.put(FetchDone(request))

    pull = SwarmPull(
        manifest, partial, [PEER, *members], PullStats(digest=manifest.digest), settings=PullSettings(stall_timeout=30.0),
        channels=PeerChannels(), download_limit=None, holding=lambda peer, digest: peer_calls.Holding(set(), False, 0),
    )
    pull.workers.fetch = fetch  # type: ignore[method-assign]
    assert _run(pull, partial).digest == manifest.digest
    assert sorted(c for run in runs for c in run) == list(range(weights.chunk_count))
    if others == 0:
        # one chunk at random, then runs in file order (cut only by a chunk asked for already): 5-7 requests for 17
        assert len(runs[0]) == 1 and max(map(len, runs)) >= 4 and len(runs) <= 7 and most[0] == 2, runs
        assert all(run == list(range(run[0], run[-1] + 1)) for run in runs), runs
    else:
        assert [len(run) for run in runs] == [1] * weights.chunk_count and most[0] == 1, runs
