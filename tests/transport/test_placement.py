"""Rendezvous placement (``adapter_fabric.transport.placement``) and re-homing (``rehoming``): pure, in-process."""

from __future__ import annotations

import statistics

import numpy as np
from adapter_fabric.transport import placement, rehoming
from adapter_fabric.transport.placement import Fleet, id_key, member_key, moved, score
from hypothesis import given, settings
from hypothesis import strategies as st

MEMBERS = [f"10.0.{i // 200}.{i % 200}:50051" for i in range(50)]
IDS = [f"team-{i % 7}/adapter-{i}" for i in range(3000)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1))
def test_the_vectorised_score_is_the_reference_score(key: int, member: int) -> None:
    vectorised = placement._scores(np.array([key ^ member], dtype=np.uint64))
    assert int(vectorised[0]) == score(key, member)


def test_homes_are_the_highest_scores_and_the_same_whatever_order_or_case_the_members_come_in() -> None:
    fleet = Fleet.of(MEMBERS)
    shuffled = Fleet.of([m.upper() for m in reversed(MEMBERS)])
    for adapter_id in IDS[:200]:
        homes = fleet.homes(adapter_id, 3)
        by_score = sorted(MEMBERS, key=lambda m: -score(id_key(adapter_id), member_key(m)))[:3]
        assert homes == by_score == shuffled.homes(adapter_id, 3)
        assert len(set(homes)) == 3


def test_many_at_once_equals_one_at_a_time_and_a_pin_is_homed_with_its_id() -> None:
    fleet = Fleet.of(MEMBERS)
    assert fleet.homes_of_many(IDS[:500], 3) == [fleet.homes(a, 3) for a in IDS[:500]]
    assert fleet.homes_of_many(IDS[:50], 12) == [fleet.homes(a, 12) for a in IDS[:50]]
    assert fleet.homes("team/a@v2") == fleet.homes("team/a")
    small = Fleet.of(MEMBERS[:2])
    assert sorted(small.homes("x", 3)) == sorted(m.lower() for m in MEMBERS[:2])
    assert Fleet.of([]).homes("x") == [] and Fleet.of([]).homes_of_many(["x"]) == [[]]


def test_homes_spread_evenly() -> None:
    fleet = Fleet.of(MEMBERS)
    load = dict.fromkeys(fleet.members, 0)
    for homes in fleet.homes_of_many(IDS, 3):
        for home in homes:
            load[home] += 1
    mean = statistics.mean(load.values())  # 3000 * 3 / 50 = 180
    assert max(load.values()) < 1.35 * mean and min(load.values()) > 0.65 * mean


def test_a_join_moves_only_homes_to_the_newcomer_and_about_one_nth_of_them() -> None:
    before = Fleet.of(MEMBERS)
    after = Fleet.of([*MEMBERS, "10.9.9.9:50051"])
    old, new = before.homes_of_many(IDS, 3), after.homes_of_many(IDS, 3)
    gained = {m for o, n in zip(old, new, strict=False) for m in set(n) - set(o)}
    assert gained == {"10.9.9.9:50051"}
    ideal = 3 * len(IDS) / len(after)  # the newcomer's fair share
    assert 0.7 * ideal < moved(old, new) < 1.3 * ideal


def test_a_leave_moves_only_the_leavers_homes() -> None:
    before = Fleet.of(MEMBERS)
    leaver = MEMBERS[17]
    after = Fleet.of([m for m in MEMBERS if m != leaver])
    old, new = before.homes_of_many(IDS, 3), after.homes_of_many(IDS, 3)
    assert moved(old, new) == sum(leaver in o for o in old)
    for o, n in zip(old, new, strict=False):
        assert set(o) - {leaver} <= set(n)


def test_after_a_join_the_former_homes_push_to_the_newcomer_and_nobody_else_pushes() -> None:
    before = Fleet.of(MEMBERS)
    newcomer = "10.9.9.9:50051"
    after = Fleet.of([*MEMBERS, newcomer])
    plans = {m: rehoming.pushes(IDS, before, after, m, 3) for m in before.members}
    pushed: dict[str, list[str]] = {}
    for member, plan in plans.items():
        for adapter_id, arrivals in plan.items():
            assert arrivals == [newcomer] and member in before.homes(adapter_id, 3)
            pushed.setdefault(adapter_id, []).append(member)
    assert set(pushed) == {a for a in IDS if newcomer in after.homes(a, 3)}
    assert all(len(pushers) == 3 for pushers in pushed.values())  # each former home (the newcomer pulls once)


def test_when_every_former_home_left_each_holder_pushes() -> None:
    before = Fleet.of(MEMBERS)
    gone = set(before.homes(IDS[0], 3))
    after = Fleet.of([m for m in MEMBERS if m.lower() not in gone])
    holder = next(m for m in after.members)
    assert rehoming.pushes([IDS[0]], before, after, holder, 3)[IDS[0]] == [h for h in after.homes(IDS[0], 3) if h != holder]
    assert rehoming.pushes([IDS[0]], before, before, holder, 3) == {} and rehoming.pushes([IDS[0]], before, after, None, 3) == {}


def test_after_a_join_the_home_it_displaced_tells_every_home_and_a_guest_holder_only_the_newcomer() -> None:
    before = Fleet.of(MEMBERS)
    newcomer = "10.9.9.9:50051"
    after = Fleet.of([*MEMBERS, newcomer])
    moved_ids = [a for a in IDS if newcomer in after.homes(a, 3)]
    displaced = {a: next(m for m in before.homes(a, 3) if m not in after.homes(a, 3)) for a in moved_ids}
    for adapter_id, former in list(displaced.items())[:50]:  # its copy was a home's, in no directory: every home hears of it
        assert rehoming.announcements([adapter_id], before, after, former, 3) == {adapter_id: after.homes(adapter_id, 3)}
        guest = next(m for m in MEMBERS if m.lower() not in before.homes(adapter_id, 3))  # announced to the homes when it pulled
        assert rehoming.announcements([adapter_id], before, after, guest, 3) == {adapter_id: [newcomer]}
        stayed = next(m for m in after.homes(adapter_id, 3) if m in before.homes(adapter_id, 3))
        assert rehoming.announcements([adapter_id], before, after, stayed, 3) == {}  # a home answers from its own store
    # bounded by the ids whose homes changed: the rest say nothing
    unmoved = [a for a in IDS[:500] if a not in displaced]
    assert all(rehoming.announcements(unmoved, before, after, m, 3) == {} for m in MEMBERS[:10])
    assert rehoming.announcements(IDS[:5], before, after, None, 3) == {}
