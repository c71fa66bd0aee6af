"""A pull from several peers goes at a swarm's pace until the peer holding the adapter says nobody else pulls it from
there; then it ramps to a lone pull's (``adapter_fabric.transport.pace``), and back at the first answer naming others.

The seeder's side: who pulled a digest lately (``recent_pullers``), and how its count travels (gRPC metadata, the data
channel's PICKED frame) so that older nodes on either end read what they read before.
"""

from __future__ import annotations

import random

from adapter_fabric.transport import data_frames, fetch_metadata, swarm
from adapter_fabric.transport.pace import MAX_ALONE, Pace, pace_for
from adapter_fabric.transport.recent_pullers import DIGESTS_KEPT, LATELY_S, PULLERS_KEPT, RecentPullers

MIB = 1 << 20


def _lone_answers(pace: Pace, plan: swarm.SwarmPlan, count: int) -> list[tuple[int, int]]:
    """``(window, max_run)`` after each of ``count`` answers saying nobody else pulls."""
    seen = []
    for _ in range(count):
        pace.heard(plan, 0)
        seen.append((pace.window, pace.max_run))
    return seen


def test_a_pull_told_nobody_else_pulls_doubles_its_run_up_to_one_source_s_on_two_streams() -> None:
    pace = pace_for(MIB, 84, peers=7, window=None, several=True)  # a named seeder and six members
    plan = swarm.new_plan(84, (), ["seed", *[f"m{i}" for i in range(6)]], seed=1)
    assert (pace.window, pace.max_run) == (swarm.WINDOW, 3)  # the swarm's: 84 // (4 x 7 peers)
    assert pace.lone_run == swarm.run_length(MIB, 84, 1, swarm.ONE_SOURCE_WINDOW) == 21
    assert _lone_answers(pace, plan, 7) == [(2, 3), (2, 4), (2, 8), (2, 16), (2, 21), (2, 21), (2, 21)]
    for _ in range(2 * MAX_ALONE):
        pace.heard(plan, 0)
    assert pace.alone == MAX_ALONE and pace.max_run == 21  # bounded however long the pull


def test_one_answer_naming_other_pullers_returns_to_the_swarm_s_pace_and_a_silent_one_changes_nothing() -> None:
    pace = pace_for(MIB, 64, peers=16, window=None, several=True)
    plan = swarm.new_plan(64, (), [f"p{i}" for i in range(16)], seed=2)
    swarm_pace = (pace.window, pace.max_run)
    assert swarm_pace == (1, 1)
    _lone_answers(pace, plan, 3)
    assert (pace.window, pace.max_run) == (2, 8)
    pace.heard(plan, None)  # an older node says nothing: the pace stays
    assert (pace.window, pace.max_run) == (2, 8)
    pace.heard(plan, 3)
    assert (pace.window, pace.max_run) == swarm_pace
    _lone_answers(pace, plan, 2)
    pace.heard(plan, 2**64 - 2)  # the most a data channel frame can say
    assert (pace.window, pace.max_run) == swarm_pace
    # a rollout's first puller heard "nobody" once, before the others asked: it took one run of two chunks
    assert _lone_answers(pace, plan, 1) == [(2, 2)]
    pace.heard(plan, 1)
    assert (pace.window, pace.max_run) == swarm_pace


def test_a_lone_pull_asks_for_the_file_in_order_and_a_swarm_again_at_random() -> None:
    peers = ["seed", "m1", "m2"]
    plan = swarm.new_plan(64, (), peers, seed=3)
    swarm.set_holding(plan, "seed", (), complete=True)
    pace = pace_for(MIB, 64, peers=3, window=None, several=True)
    _lone_answers(pace, plan, 3)
    runs = []
    while plan.needed:
        for request in swarm.plan_requests(plan, 0.0, pace.window, pace.max_run):
            runs.append(request.chunks)
            for chunk in request.chunks:
                swarm.chunk_verified(plan, chunk, request)
            swarm.finish(plan, request)
    assert runs == [list(range(i, min(64, i + 8))) for i in range(0, 64, 8)]  # whole runs, no fragments at random starts
    pace.heard(plan, 2)
    assert plan.tiebreak != sorted(plan.tiebreak)  # spread again: a rollout's pullers ask the seeder for different chunks


def test_an_operator_s_window_holds_at_both_paces_and_a_peer_that_refused_a_second_stream_gets_one() -> None:
    set_by_operator = pace_for(MIB, 84, peers=7, window=3, several=True)
    assert set_by_operator.swarm_window == set_by_operator.lone_window == 3
    refused_beside = pace_for(MIB, 84, peers=7, window=None, several=False)
    assert refused_beside.lone_window == 1 and refused_beside.lone_run == 28  # one stream: 3 equal runs of at most RUN_BYTES


def test_the_seeder_counts_the_other_pullers_of_a_digest_seen_lately() -> None:
    now = [100.0]
    pullers = RecentPullers(clock=lambda: now[0])
    a, b, c = ("10.0.0.1", 50051), ("10.0.0.2", 50051), ("10.0.0.1", 50052)  # c: a second node on a's host
    assert pullers.others("d1", a) == 0
    assert pullers.others("d1", a) == 0  # itself is not another
    assert pullers.others("d1", b) == 1
    assert pullers.others("d2", c) == 0  # another digest
    assert pullers.others("d1", c) == 2
    now[0] += LATELY_S / 2
    assert pullers.others("d1", a) == 2
    now[0] += LATELY_S * 0.75  # b and c asked more than LATELY_S ago, a did not
    assert pullers.others("d1", b) == 1
    now[0] += LATELY_S * 2
    assert pullers.others("d1", a) == 0


def test_an_unnamed_request_is_told_nothing_and_counts_as_another_puller_for_the_named() -> None:
    pullers = RecentPullers(clock=lambda: 0.0)
    assert pullers.others("d", None) is None
    assert pullers.others("d", None) is None
    assert pullers.others("d", ("10.0.0.1", 1)) == 1  # all unnamed requests are one other puller


def test_what_the_seeder_remembers_is_bounded_in_digests_and_in_pullers() -> None:
    now = [0.0]
    pullers = RecentPullers(clock=lambda: now[0])
    for i in range(PULLERS_KEPT + 50):
        now[0] += 1e-6
        pullers.others("crowded", ("10.0.0.1", 1 + i))
    assert pullers.others("crowded", ("10.0.0.2", 1)) == PULLERS_KEPT  # the oldest went; "many" all the same
    pullers.others("first", ("10.0.0.1", 1))
    for i in range(DIGESTS_KEPT):
        pullers.others(f"d{i}", ("10.0.0.1", 1))
    assert pullers.others("first", ("10.0.0.3", 1)) == 0  # forgotten: the most recent DIGESTS_KEPT are kept
    assert pullers.others(f"d{DIGESTS_KEPT - 1}", ("10.0.0.3", 1)) == 1  # the most recent ones are not


def test_the_count_travels_in_grpc_metadata_and_a_missing_or_junk_one_reads_as_not_said() -> None:
    told = fetch_metadata.picked([3, 1], 4)
    assert fetch_metadata.picked_chunks(told) == [3, 1] and fetch_metadata.other_pullers(told) == 4
    assert fetch_metadata.other_pullers(fetch_metadata.picked([3, 1])) is None
    for junk in ("-1", "x", "1" * 12, "", "٣"):
        assert fetch_metadata.other_pullers(((fetch_metadata.OTHER_PULLERS_KEY, junk),)) is None
    assert fetch_metadata.other_pullers(((fetch_metadata.OTHER_PULLERS_KEY, b"3"),)) is None


def test_the_count_rides_in_the_picked_frame_s_offset_which_older_pullers_ignore() -> None:
    offset, payload = data_frames.encode_picked([5, 9], 0)
    assert (offset, payload) == (1, b"5,9")  # the payload an older puller parses, unchanged
    assert data_frames.decode_picked(payload, offset) == ([5, 9], 0)
    assert data_frames.decode_picked(*reversed(data_frames.encode_picked([2], 7))) == ([2], 7)
    assert data_frames.encode_picked([5], None) == (0, b"5")
    assert data_frames.decode_picked(b"5", 0) == ([5], None)  # an older seeder's frame: not said
    assert data_frames.decode_picked(b"5", 2**64 - 1) == ([5], 2**64 - 2)  # the frame's largest offset: "many", no error
    rng = random.Random(4)
    for _ in range(200):
        chunks, others = rng.sample(range(1000), rng.randint(0, 20)), rng.choice([None, 0, rng.randint(1, 10**6)])
        offset, payload = data_frames.encode_picked(chunks, others)
        assert data_frames.decode_picked(payload, offset) == (chunks, others)
