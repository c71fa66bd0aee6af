#!/usr/bin/env python3
"""A fleet of 1,000 or 10,000 nodes in one process: the real placement, lookup, eviction and re-homing code over a
simulated network, driven by a Zipf stream of requests with members joining and leaving.

Real code (the node runs the same): ``placement.Fleet`` (homes), ``lookup.find_sources`` (homes first, the holders
they name, a bounded fan-out; load-aware choice by each holder's streams), ``holder_directory.HolderDirectory`` (what a
home knows of other holders), ``store.eviction.choose_victims`` and ``home_copies.last_copies`` (non-home copies first,
the last home copy never goes, last copies handed to a home), ``rehoming.pushes`` (who pushes what after a change) and
``rehoming.announcements`` (which holders tell which new homes of their copies).
Simulated: calls (an RPC costs ``--rtt``), links (each node's ``--link`` shared by the streams it serves), the origin
(``--origin-latency`` then ``--origin-rate`` per object), and time (an event queue; no wall clock).

    python scripts/sim_fleet.py --nodes 1000 --adapters 100000 --requests 200000
    python scripts/sim_fleet.py --nodes 10000 --adapters 100000 --requests 200000

Prints one table (Markdown) of: lookups per miss, origin fetches per adapter, bytes moved per join/leave against the
ideal (the newcomer's or the leaver's fair share of home copies), hot-spot load (most bytes served by one node over
the mean), a miss's time to ready against one pull alone, fan-outs, re-homing pushes and announcements, refusals
and last copies lost.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.flag_bounds import refuse_out_of_range
from adapter_fabric.store.eviction import Candidate, choose_victims
from adapter_fabric.transport import home_copies, placement, rehoming
from adapter_fabric.transport.holder_directory import HolderDirectory
from adapter_fabric.transport.lookup import Holder, HomeAnswer, Unreachable, find_sources
from adapter_fabric.transport.placement import Fleet, first_live

MB = 1 << 20


@dataclass
class SimNode:
    address: str
    capacity: int
    held: dict[int, float] = field(default_factory=dict)  # adapter -> last used (simulated seconds)
    used: int = 0
    streams: int = 0  # Fetch streams it serves now
    served: int = 0  # bytes it served in all
    directory: HolderDirectory = field(default_factory=HolderDirectory)


@dataclass
class Tally:
    hits: int = 0
    misses: int = 0
    lookups: list[int] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    alone_s: list[float] = field(default_factory=list)
    origin_fetches: dict[int, int] = field(default_factory=dict)
    fanouts: int = 0  # members asked beyond the homes
    fanout_misses: int = 0
    refusals: int = 0
    handoffs: int = 0
    evict_asks: int = 0
    moves: list[tuple[str, int, float, int, int]] = field(default_factory=list)  # (kind, bytes pulled, ideal, homes moved, homes)
    pushes: int = 0  # re-homing pushes asked (an arrival pulls each adapter once)
    announces: int = 0  # re-homing announcements (a holder no home of an id any more, or a guest, to the homes new to it)
    announces_max: int = 0  # the most one node sent after one change (a node queues at most 128: node.homes)
    lost: int = 0  # adapters whose every copy in the fleet left with a member (still at the origin)
    evicted_last: int = 0  # adapters whose last copy an eviction dropped (never: checked)


class Sim:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.k = args.homes
        n, a = args.nodes, args.adapters
        self.ids = [f"team-{i % 97}/adapter-{i}" for i in range(a)]
        sizes = np.clip(np.random.default_rng(args.seed).lognormal(np.log(32 * MB), 0.7, a), 4 * MB, 512 * MB)
        self.sizes = sizes.astype(np.int64)
        share = int(self.k * int(self.sizes.sum()) / n)
        self.capacity = int(args.capacity_share * share)
        self.nodes = {addr: SimNode(addr, self.capacity) for addr in (self._address(i) for i in range(n))}
        self.next_address = n
        self.away: dict[str, SimNode] = {}  # members that left, with their stores (a rejoin brings them back)
        self.fleet = Fleet.of(self.nodes)
        self.keys = np.array([placement.id_key(i) for i in self.ids], dtype=np.uint64)
        started = time.monotonic()
        self.homes = self.fleet.homes_of_many(self.ids, self.k)
        self.placement_s = time.monotonic() - started
        self.holders: dict[int, set[str]] = {}  # adapter -> nodes holding it whole
        self.inflight: dict[int, tuple[float, str]] = {}  # adapter -> (ready at, first home fetching it from the origin)
        self.events: list[tuple[float, int, str, tuple]] = []
        self.seq = 0
        self.now = 0.0
        self.down: set[str] = set()
        self.tally = Tally()
        ranks = np.arange(1, a + 1, dtype=np.float64) ** -args.zipf
        self.popularity = np.cumsum(ranks / ranks.sum())
        self.order = np.random.default_rng(args.seed + 1).permutation(a)

    @staticmethod
    def _address(i: int) -> str:
        return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:50051"

    # ------------------------------------------------------------ time

    def at(self, when: float, kind: str, *data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, data))

    def advance(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            when, _, kind, data = heapq.heappop(self.events)
            self.now = when
            if kind == "stream-end":
                node = self.nodes.get(data[0]) or self.away.get(data[0])
                if node is not None:
                    node.streams -= 1
            elif kind == "holds":
                self.store(*data)
            elif kind == "origin-done":
                self.inflight.pop(data[0], None)
        self.now = until

    def transfer(self, source: str, size: int, start: float) -> float:
        """A stream from ``source`` starting at ``start``: its duration at the source's share of its link."""
        node = self.nodes[source]
        node.streams += 1
        node.served += size
        duration = size / (self.args.link / node.streams)
        self.at(start + duration, "stream-end", source)
        return duration

    # ------------------------------------------------------------ holdings

    def store(self, address: str, adapter: int) -> None:
        node = self.nodes.get(address)
        if node is None or adapter in node.held:
            return
        size = int(self.sizes[adapter])
        if node.used + size > node.capacity and not self.evict(node, size):
            self.tally.refusals += 1
            return
        node.held[adapter] = self.now
        node.used += size
        self.holders.setdefault(adapter, set()).add(address)
        if address not in self.homes[adapter]:  # a non-home holder tells the homes (Announce)
            for home in self.homes[adapter]:
                if home in self.nodes:
                    self.nodes[home].directory.told(self.ids[adapter], address, str(adapter), True, self.now)

    def drop(self, node: SimNode, adapter: int) -> None:
        del node.held[adapter]
        node.used -= int(self.sizes[adapter])
        self.holders[adapter].discard(node.address)
        self.tally.evicted_last += not self.holders[adapter]
        for home in self.homes[adapter]:
            if home in self.nodes:
                self.nodes[home].directory.dropped(self.ids[adapter], node.address)

    def evict(self, node: SimNode, needed: int) -> bool:
        """The node's eviction round (node/eviction.py's order): choose, ask the homes, keep last copies, drop the rest."""
        me = node.address
        candidates = [
            Candidate(str(a), (self.ids[a],), int(self.sizes[a]), used, home=me in self.homes[a]) for a, used in node.held.items()
        ]
        while True:
            try:
                victims = choose_victims(candidates, needed, node.used, node.capacity, 0.9, "a pull")
            except QuotaExceeded:
                return False
            homes = {v.digest: self.homes[int(v.digest)] for v in victims}
            self.tally.evict_asks += sum(len(h) for h in homes.values())
            copies = {d: {h for h in hs if h != me and int(d) in self._held_at(h)} for d, hs in homes.items()}
            kept = home_copies.last_copies([v.digest for v in victims], homes, copies, me, self.down)
            if not kept:
                for victim in victims:
                    self.drop(node, int(victim.digest))
                return True
            for digest, keep in kept.items():
                if keep.hand_to is not None:  # handed to a home in the background; held meanwhile
                    self.tally.handoffs += 1
                    self.at(self.now + self.transfer(me, int(self.sizes[int(digest)]), self.now), "holds", keep.hand_to, int(digest))
            candidates = [Candidate(c.digest, c.ids, c.size, c.last_used, kept[c.digest].why, c.home) if c.digest in kept else c for c in candidates]

    def _held_at(self, address: str) -> dict[int, float]:
        node = self.nodes.get(address)
        return node.held if node is not None and address not in self.down else {}

    # ------------------------------------------------------------ a request

    def ask(self, adapter: int, member: str) -> HomeAnswer:
        node = self.nodes.get(member)
        if node is None or member in self.down:
            raise Unreachable(member)
        holders = [Holder(member, True, node.streams)] if adapter in node.held else []
        holders += [Holder(t.address, t.complete) for t in node.directory.holders(self.ids[adapter], self.now)]
        return HomeAnswer(str(adapter) if holders else "", tuple(holders))

    def probe(self, adapter: int, member: str) -> Holder:
        node = self.nodes.get(member)
        if node is None or member in self.down:
            raise Unreachable(member)
        return Holder(member, adapter in node.held, node.streams)

    def request(self, address: str, adapter: int) -> None:
        node = self.nodes[address]
        if adapter in node.held:
            node.held[adapter] = self.now
            self.tally.hits += 1
            return
        self.tally.misses += 1
        rtt, size = self.args.rtt, int(self.sizes[adapter])
        homes = self.homes[adapter]
        found = find_sources(
            homes, lambda m: self.ask(adapter, m), probe=lambda m: self.probe(adapter, m), skip=self.down, me=address,
            beyond=lambda: self.fleet.ranked(self.ids[adapter], self.k + 16)[self.k :], probes=self.k - 1, rng=self.rng,
        )  # fmt: skip
        self.tally.fanouts += found.fanned_out
        self.tally.fanout_misses += bool(found.fanned_out)
        lookups = found.lookups + 1  # and the manifest from the source
        sources = [m for m in found.sources if m in self.nodes and m not in self.down and adapter in self.nodes[m].held]
        lookups += found.sources.index(sources[0]) if sources else len(found.sources)  # a manifest asked of a holder gone stale
        alone = size / self.args.link
        if sources:  # a swarm over the complete ones (each sends its share), else the first
            start = self.now + lookups * rtt
            swarm = [m for m in sources if m in found.complete] or sources[:1]
            ready = start + max(alone, *(self.transfer(m, size // len(swarm), start) for m in swarm))
        else:  # held nowhere in the fleet: the first live home fetches it from the origin, the asker pulls from it
            first = first_live(homes, self.down) or address
            lookups += 1 if first != address else 0  # asking the first home to fetch it
            if adapter in self.inflight:
                fetched, first = self.inflight[adapter]
            else:
                self.tally.origin_fetches[adapter] = self.tally.origin_fetches.get(adapter, 0) + 1
                fetched = self.now + lookups * rtt + self.args.origin_latency + size / self.args.origin_rate
                self.inflight[adapter] = (fetched, first)
                self.at(fetched, "origin-done", adapter)
                self.at(fetched, "holds", first, adapter)
                for home in homes:  # the first home publishes to the other homes
                    if home != first and home in self.nodes and home not in self.down:
                        self.at(fetched + self.transfer(first, size, fetched), "holds", home, adapter)
            ready = fetched if first == address else fetched + self.transfer(first, size, fetched)
            alone += self.args.origin_latency + size / self.args.origin_rate
        self.tally.lookups.append(lookups)
        self.tally.ready_s.append(ready - self.now)
        self.tally.alone_s.append(alone)
        self.at(ready, "holds", address, adapter)

    # ------------------------------------------------------------ churn

    def change(self, kind: str) -> None:
        before = self.fleet
        if kind == "join" and self.away and self.rng.random() < 0.5:
            kind = "rejoin"
            address, node = self.away.popitem()  # a member that left comes back with its store
            self.nodes[address] = node
            for adapter in node.held:
                self.holders.setdefault(adapter, set()).add(address)
        elif kind == "join":
            address = self._address(self.next_address)
            self.next_address += 1
            self.nodes[address] = SimNode(address, self.capacity)
        else:
            address = self.rng.choice(sorted(self.nodes))
            node = self.away[address] = self.nodes.pop(address)
            for adapter in node.held:
                self.holders[adapter].discard(address)
                self.tally.lost += not self.holders[adapter]
        after = self.fleet = Fleet.of(self.nodes)
        changed = self._rehome(before, after, address, kind)
        home_copies_held = sum(int(self.sizes[a]) * len(h & set(self.homes[a])) for a, h in self.holders.items())
        ideal = home_copies_held / max(len(before), len(after))  # one member's fair share of the home copies held
        moved = 0
        for adapter in changed:
            ids, pulled = [self.ids[adapter]], set()
            for holder in sorted(self.holders.get(adapter, ())):
                for arrival in rehoming.pushes(ids, before, after, holder, self.k).get(ids[0], []):
                    self.tally.pushes += 1
                    if adapter not in self.nodes[arrival].held and arrival not in pulled:  # pulled once; later pushes find it
                        pulled.add(arrival)
                        moved += int(self.sizes[adapter])
                        self.at(self.now + self.transfer(holder, int(self.sizes[adapter]), self.now), "holds", arrival, adapter)
        self.tally.moves.append((kind, moved, ideal, len(changed), self.k * len(self.ids)))
        self._announce(changed, before, after)

    def _announce(self, changed: list[int], before: Fleet, after: Fleet) -> None:
        """Each holder of a re-homed adapter it is no home of tells the homes new to it (``rehoming.announcements``)."""
        sent: dict[str, int] = {}
        for adapter in changed:
            adapter_id = self.ids[adapter]
            for holder in sorted(self.holders.get(adapter, ())):
                for home in rehoming.announcements([adapter_id], before, after, holder, self.k).get(adapter_id, []):
                    if home in self.nodes:
                        self.nodes[home].directory.told(adapter_id, holder, str(adapter), True, self.now)
                        sent[holder] = sent.get(holder, 0) + 1
        self.tally.announces += sum(sent.values())
        self.tally.announces_max = max(self.tally.announces_max, max(sent.values(), default=0))

    def _rehome(self, before: Fleet, after: Fleet, member: str, kind: str) -> list[int]:
        """The homes table after one member joined or left, changed only where it must be (checked against a sample)."""
        if kind != "leave":
            kth = np.array([placement.member_key(h[-1]) for h in self.homes], dtype=np.uint64)
            beats = placement.member_scores(member, self.keys) > placement.pair_scores(self.keys, kth)
            changed = np.flatnonzero(beats).tolist()
        else:
            changed = [a for a, homes in enumerate(self.homes) if member in homes]
        for adapter, homes in zip(changed, after.homes_of_many([self.ids[a] for a in changed], self.k), strict=True):
            self.homes[adapter] = homes
        for adapter in self.rng.sample(range(len(self.ids)), 50):
            assert self.homes[adapter] == after.homes(self.ids[adapter], self.k), "incremental placement drifted"
        return changed

    # ------------------------------------------------------------ run

    def run(self) -> Tally:
        args = self.args
        churn = {int(args.requests * (i + 1) / (args.churn + 1)): ("join" if i % 2 else "leave") for i in range(args.churn)}
        t = 0.0
        for r in range(args.requests):
            t += self.rng.expovariate(args.rate)
            self.advance(t)
            if r in churn:
                self.change(churn[r])
            address = self.rng.choice(self.fleet.members)
            adapter = int(self.order[int(np.searchsorted(self.popularity, self.rng.random()))])
            self.request(address, adapter)
        self.advance(float("inf"))
        return self.tally


def report(sim: Sim, wall: float) -> str:
    t, args = sim.tally, sim.args
    loads = [n.served for n in sim.nodes.values()]
    fetches = list(t.origin_fetches.values())
    ratio = sorted(r / a for r, a in zip(t.ready_s, t.alone_s, strict=True))
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0  # noqa: E731

    def moved(kind: str) -> str:
        events = [m for m in t.moves if m[0] == kind]
        if not events:
            return "-"
        pulled, ideal = sum(m[1] for m in events), sum(m[2] for m in events)
        share = statistics.mean(m[3] / m[4] for m in events)
        n = statistics.mean(len(sim.nodes) for _ in events)
        return f"{pulled / max(1.0, ideal):.2f}x ideal; homes moved {share:.5f} of all (1/n = {1 / n:.5f}); {len(events)} events"
    rows = [
        ("nodes / adapters / homes", f"{args.nodes:,} / {args.adapters:,} / {args.homes}"),
        ("requests (hits / misses)", f"{args.requests:,} ({t.hits:,} / {t.misses:,})"),
        ("lookups per miss: median / p99 / max", f"{statistics.median(t.lookups):g} / {pct(t.lookups, 0.99):g} / {max(t.lookups)}"),
        ("misses that fanned out beyond the homes", f"{t.fanout_misses:,} ({t.fanouts:,} members asked in all)"),
        ("origin fetches per adapter fetched: mean / max", f"{statistics.mean(fetches):.3f} / {max(fetches)} ({len(fetches):,} adapters)"),
        ("bytes moved per join (a new, empty member)", moved("join")),
        ("bytes moved per rejoin (a member back with its store)", moved("rejoin")),
        ("bytes moved per leave", moved("leave")),
        ("re-homing pushes asked", f"{t.pushes:,}"),
        ("re-homing announcements: in all / most from one node after one change", f"{t.announces:,} / {t.announces_max:,}"),
        ("hot spot: most bytes served by one node / mean", f"{max(loads) / max(1e-9, statistics.mean(loads)):.1f}x"),
        ("miss time to ready: p50 / p99 (simulated s)", f"{pct(t.ready_s, 0.5):.3f} / {pct(t.ready_s, 0.99):.3f}"),
        ("miss time over one pull alone: p50 / p99", f"{pct(ratio, 0.5):.2f}x / {pct(ratio, 0.99):.2f}x"),
        ("last copies handed to a home / eviction asks", f"{t.handoffs:,} / {t.evict_asks:,}"),
        ("refused for room", f"{t.refusals:,}"),
        ("last copies evicted / adapters whose copies all left with members (at the origin still)", f"{t.evicted_last} / {t.lost}"),
        ("wall time (placement of every adapter)", f"{wall:.0f} s ({sim.placement_s:.0f} s)"),
    ]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--adapters", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--homes", type=int, default=placement.DEFAULT_HOMES)
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the popularity of adapters (default 1.0)")
    parser.add_argument("--rate", type=float, default=2000.0, help="requests per simulated second, fleet-wide")
    parser.add_argument("--churn", type=int, default=10, help="membership changes, alternately leave and join, spread over the run")
    parser.add_argument("--capacity-share", type=float, default=0.5, help="each node's store over its fair share of every home copy")
    parser.add_argument("--link", type=float, default=1.25e9, help="bytes/s each node's link carries (default 10 Gb/s)")
    parser.add_argument("--rtt", type=float, default=0.0005, help="seconds per lookup call")
    parser.add_argument("--origin-latency", type=float, default=0.05)
    parser.add_argument("--origin-rate", type=float, default=200e6, help="bytes/s of one object from the origin")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    refuse_out_of_range(parser, (
        ("--nodes", args.nodes, 2, 20_000, "a leave must leave a member; 10,000 takes minutes here"),
        ("--adapters", args.adapters, 50, 200_000, "a membership change checks the placement of 50"),
        ("--requests", args.requests, 1, 1_000_000, "200,000 take minutes here"),
        ("--homes", args.homes, 1, 64, "a node's --homes takes at most 64; 0, no placement, is nothing to simulate"),
        ("--zipf", args.zipf, 0, 3, "the popularity exponent s"),
        ("--rate", args.rate, 0.01, 1_000_000_000, "requests per simulated second"),
        ("--churn", args.churn, 0, 1000, "0: no member leaves or joins; each change scores every adapter's homes again"),
        ("--capacity-share", args.capacity_share, 0.01, 100, "each store over its fair share of the home copies"),
        ("--link", args.link, 1_000_000, 1_000_000_000_000, "bytes/s of a node's link"),
        ("--rtt", args.rtt, 0, 10, "simulated seconds per lookup call"),
        ("--origin-latency", args.origin_latency, 0, 600, "simulated seconds before the origin's first byte"),
        ("--origin-rate", args.origin_rate, 1_000_000, 1_000_000_000_000, "bytes/s of one object from the origin"),
        ("--seed", args.seed, 0, 2**32 - 1, "numpy's generators take no negative seed"),
    ), grouped=True)
    started = time.monotonic()
    sim = Sim(args)
    sim.run()
    print(report(sim, time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
