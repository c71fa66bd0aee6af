"""The lookup policy (``adapter_fabric.transport.lookup``), the holder directory and the member view: in-process."""

from __future__ import annotations

import random

from adapter_fabric.store.eviction import LAST_COPY, Candidate, choose_victims
from adapter_fabric.transport.holder_directory import HolderDirectory
from adapter_fabric.transport.home_copies import LAST_HOME_COPY, Keep, last_copies
from adapter_fabric.transport.lookup import BUSY_STREAMS, Holder, HomeAnswer, Unreachable, find_sources, rank_holders
from adapter_fabric.transport.members import MemberView

HOMES = ["h1:1", "h2:1", "h3:1"]


class Fleet:
    """Answers as members would: ``held`` (address -> streams) hold the id; the homes know ``told`` too."""

    def __init__(self, held: dict[str, int], told: tuple[str, ...] = (), down: tuple[str, ...] = ()) -> None:
        self.held, self.told, self.down = held, told, down
        self.asked: list[str] = []

    def ask(self, member: str) -> HomeAnswer:
        self.asked.append(member)
        if member in self.down:
            raise Unreachable(member)
        holders = [Holder(member, True, self.held[member])] if member in self.held else []
        if member in HOMES:
            holders += [Holder(t, True) for t in self.told]
        return HomeAnswer("d" * 64 if holders else "", tuple(holders))

    def probe(self, member: str) -> Holder:
        self.asked.append(f"probe {member}")
        if member in self.down:
            raise Unreachable(member)
        return Holder(member, True, self.held[member])


def test_a_home_that_holds_it_costs_one_ask() -> None:
    fleet = Fleet({"h1:1": 0, "h2:1": 0, "h3:1": 0})
    found = find_sources(HOMES, fleet.ask, probe=fleet.probe, probes=2)
    assert found.sources == ["h1:1"] and found.lookups == 1 and found.digest == "d" * 64 and not found.fanned_out


def test_a_busy_home_gives_way_to_an_idle_holder_it_names_within_k_plus_one_lookups() -> None:
    fleet = Fleet({"h1:1": BUSY_STREAMS + 2, "a:1": 5, "b:1": 0}, told=("a:1", "b:1"))
    found = find_sources(HOMES, fleet.ask, probe=fleet.probe, probes=2)
    assert found.sources == ["b:1", "a:1", "h1:1"]
    assert found.asks == 1 and found.probes == 2 and found.lookups + 1 <= len(HOMES) + 1


def test_homes_that_are_down_are_passed_over_and_named() -> None:
    fleet = Fleet({"h3:1": 0}, down=("h1:1",))
    found = find_sources(HOMES, fleet.ask, skip={"h2:1"})
    assert found.sources == ["h3:1"] and found.unreachable == ["h1:1"] and fleet.asked == ["h1:1", "h3:1"]
    mine = find_sources(HOMES, Fleet({}).ask, me="h1:1", beyond=lambda: ["x:1"])
    assert mine.asks == 2 and mine.fanned_out == 0  # this node is a home that does not hold it: no home was missed


def test_no_home_names_a_holder_then_a_bounded_fan_out_in_rank_order() -> None:
    fleet = Fleet({"r7:1": 0})
    beyond = [f"r{i}:1" for i in range(4, 40)]
    believed = find_sources(HOMES, fleet.ask, beyond=lambda: beyond, max_fanout=16)
    assert believed.sources == [] and believed.fanned_out == 0 and believed.asks == 3  # every home answered: an origin is next
    found = find_sources(HOMES, fleet.ask, beyond=lambda: beyond, max_fanout=16, fan_out=True)
    assert found.sources == ["r7:1"] and found.fanned_out == 4 and found.asks == 7
    one_home_down = find_sources(HOMES, fleet.ask, beyond=lambda: beyond, skip={"h2:1"})
    assert one_home_down.sources == ["r7:1"] and one_home_down.fanned_out == 4
    nowhere = find_sources(HOMES, Fleet({}).ask, beyond=lambda: beyond, max_fanout=16, fan_out=True)
    assert nowhere.sources == [] and nowhere.fanned_out == 16


def test_ranking_prefers_whole_then_idle_and_spreads_ties() -> None:
    holders = [Holder("p:1", False, 0), Holder("busy:1", True, BUSY_STREAMS), Holder("x:1", True, 1), Holder("y:1", True, 1)]
    assert [h.address for h in rank_holders(holders)] == ["x:1", "y:1", "busy:1", "p:1"]
    firsts = {rank_holders(holders, random.Random(seed))[0].address for seed in range(20)}
    assert firsts == {"x:1", "y:1"}
    assert [h.address for h in rank_holders(holders, homes={"x:1"})][:2] == ["y:1", "x:1"]  # a home gives way when not needed


def test_the_directory_is_bounded_and_forgets() -> None:
    directory = HolderDirectory(max_ids=2, max_holders=2, ttl=10)
    for i, address in enumerate(["a:1", "b:1", "c:1"]):
        directory.told("x", address, "d1", True, now=i)
    assert [t.address for t in directory.holders("x", now=3)] == ["c:1", "b:1"]
    assert directory.holders("x", now=3, digest="d2") == []
    directory.told("y", "a:1", "d1", True, now=3)
    directory.told("z", "a:1", "d1", True, now=3)
    assert directory.holders("x", now=3) == [] and len(directory) == 2  # the least recently told id went
    assert directory.holders("y", now=13) == [] and len(directory) == 1  # past the TTL
    directory.dropped("z", "a:1")
    assert len(directory) == 0


def test_every_node_with_the_same_sources_sees_the_same_fleet_and_a_silent_member_is_down_for_a_while() -> None:
    now = [0.0]
    listed = ["10.0.0.1:7", "10.0.0.2:7", "10.0.0.3:7"]
    views = [
        MemberView("0.0.0.0:7", listed, clock=lambda: now[0], is_self=lambda peer, me, mine=mine: peer == mine, down_for=30)
        for mine in listed
    ]
    assert len({v.fleet().members for v in views}) == 1 and [v.me for v in views] == listed
    static_others = MemberView("10.0.0.1:7", listed[1:], is_self=lambda peer, me: False)
    assert static_others.fleet().members == views[0].fleet().members  # listed under its listen address
    view = views[0]
    assert view.peers() == listed[1:]
    view.mark_down("10.0.0.2:7", "refused")
    view.mark_down("10.9.9.9:7")  # not a member: ignored
    assert view.live(listed) == ["10.0.0.3:7"] and view.down() == {"10.0.0.2:7"}
    now[0] = 31
    assert view.live(listed) == listed[1:]
    version = view.version
    assert view.update("dns", ["10.0.0.4:7"]) and view.version == version + 1 and len(view.fleet()) == 4
    assert not view.update("dns", ["10.0.0.4:7"])
    assert view.update("dns", []) and len(view.fleet()) == 3


def test_eviction_drops_non_home_copies_first_keeps_the_last_home_copy_and_hands_last_copies_to_a_home() -> None:
    cold = [Candidate("home-old", ("a",), 10, 1.0, home=True), Candidate("guest-new", ("b",), 10, 5.0), Candidate("guest-old", ("c",), 10, 2.0)]
    assert [v.digest for v in choose_victims(cold, 10, 30, 40, 0.5, "a test")] == ["guest-old", "guest-new"]
    homes = {"d1": ["me:1", "h2:1", "h3:1"], "d2": ["h1:1", "h2:1", "h3:1"], "d3": ["h1:1", "h2:1", "me:1"]}
    copies = {"d3": {"h2:1"}}
    kept = last_copies(["d1", "d2", "d3"], homes, copies, "me:1", down={"h1:1"})
    assert kept == {"d1": Keep(LAST_HOME_COPY, "h2:1"), "d2": Keep(LAST_COPY, "h2:1")}
    assert last_copies(["d2"], {"d2": ["h1:1"]}, {}, "me:1", down={"h1:1"}) == {"d2": Keep(LAST_COPY, None)}
