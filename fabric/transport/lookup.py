"""Finding an adapter in a fleet: its homes first, then the holders they name, then a bounded fan-out. Pure.

The asking is the caller's (``ask`` a home, ``probe`` a holder): a node passes gRPC calls
(``adapter_fabric.node.homes``), the simulation (``scripts/sim_fleet.py``) passes simulated ones, and both run
this policy:

1. Ask the id's homes in rank order (``placement.Fleet.homes``), skipping members marked down, until one names a
   holder; a home answers from what it holds and from the holders that told it (``HolderDirectory``), asking
   nobody itself.
2. Among the holders, prefer a complete one that is not busy (each holder's own report of the streams it is
   serving: a home reports its own in its answer; others are probed, within the budget), then one that is no
   home of the id: a hot adapter's homes are not its only seeds, and keep room for their other ids. Ties go to
   a random one (``rng``): pullers starting together spread out.
3. Only when no home names a holder and a home could not be asked (down, or it did not answer), or the caller has
   nothing else to try (``fan_out``: no origin): ask up to ``max_fanout`` further members (the next ranks after the
   homes first: a former home keeps its copy after a join), and say so (``Found.fanned_out``): the caller counts
   and logs it. Homes that all answered "not held" are believed: a node with an origin goes there instead.

With every home answering, a pull costs one ask, at most ``k - 1`` probes and the manifest: ``k + 1`` lookups.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["BUSY_STREAMS", "MAX_SOURCES", "Found", "Holder", "HomeAnswer", "Unreachable", "find_sources", "rank_holders"]

#: a holder serving this many streams or more is busy: another complete holder is preferred
BUSY_STREAMS = 4
#: holders a pull takes its chunks from at most (a swarm spreads its requests over them)
MAX_SOURCES = 4
#: members asked at most beyond the homes when no home names a holder
MAX_FANOUT = 16


class Unreachable(Exception):
    """Raised by ``ask`` or ``probe`` for a member that did not answer (the caller marks it down)."""


@dataclass(frozen=True)
class Holder:
    """A member holding an adapter: whole (``complete``) or in part, and the Fetch streams it is serving (-1: not said)."""

    address: str
    complete: bool
    streams: int = -1


@dataclass(frozen=True)
class HomeAnswer:
    """What a member says of an id: the digest it knows (or ""), and the holders it knows (itself among them)."""

    digest: str = ""
    holders: tuple[Holder, ...] = ()
    origin: str = ""  # the origin the digest came from, when the member knows it did


@dataclass
class Found:
    """Where to pull from: ``sources`` best first (complete holders first), the digest, and what finding them cost."""

    sources: list[str] = field(default_factory=list)
    complete: set[str] = field(default_factory=set)
    digest: str = ""
    origin: str = ""  # the origin a member said the digest came from
    asks: int = 0  # homes (and fan-out members) asked
    probes: int = 0  # holders asked for their load
    fanned_out: int = 0  # members asked beyond the homes
    unreachable: list[str] = field(default_factory=list)

    @property
    def lookups(self) -> int:
        """Calls made to find the sources (the manifest the pull then asks for is one more)."""
        return self.asks + self.probes


def find_sources(
    homes: Sequence[str],
    ask: Callable[[str], HomeAnswer],
    *,
    beyond: Callable[[], Sequence[str]] = tuple,
    probe: Callable[[str], Holder] | None = None,
    skip: Iterable[str] = (),
    me: str | None = None,
    probes: int = 2,
    fan_out: bool = False,
    max_fanout: int = MAX_FANOUT,
    max_sources: int = MAX_SOURCES,
    rng: random.Random | None = None,
) -> Found:
    """Where an id can be pulled from (see the module docstring). ``homes``: its homes in rank order; ``beyond``: the
    members to fan out to, in order (the ranks after the homes); ``skip``: members not to ask (marked down); ``me``: this node (not asked, not a source);
    ``probes``: holders at most asked for their load (``k - 1`` keeps a pull within ``k + 1`` lookups); ``fan_out``: fan
    out even when every home answered."""
    down = set(skip)
    skipped = down | ({me} if me is not None else set())
    found = Found()
    holders: dict[str, Holder] = {}

    def asked(member: str) -> bool:
        found.asks += 1
        try:
            answer = ask(member)
        except Unreachable:
            found.unreachable.append(member)
            return False
        if answer.digest and not found.digest:
            found.digest = answer.digest
        found.origin = found.origin or answer.origin
        for holder in answer.holders:
            if holder.address not in skipped and (holder.address not in holders or holder.complete and not holders[holder.address].complete):
                holders[holder.address] = holder
        return bool(holders)

    for home in homes:
        if home not in skipped and asked(home):
            break
    missed_home = any(h in down for h in homes) or bool(found.unreachable)
    if not holders and (fan_out or missed_home):
        for member in [m for m in beyond() if m not in skipped and m not in homes][:max_fanout]:
            found.fanned_out += 1
            if asked(member):
                break
    if probe is not None:
        unknown = [h for h in rank_holders(holders.values(), rng, homes) if h.complete and h.streams < 0][:probes]
        for holder in unknown:
            found.probes += 1
            try:
                holders[holder.address] = probe(holder.address)
            except Unreachable:
                found.unreachable.append(holder.address)
                del holders[holder.address]
    ranked = rank_holders(holders.values(), rng, homes)[:max_sources]
    found.sources = [h.address for h in ranked]
    found.complete = {h.address for h in ranked if h.complete}
    return found


def rank_holders(holders: Iterable[Holder], rng: random.Random | None = None, homes: Iterable[str] = ()) -> list[Holder]:
    """Complete before partial; not busy before busy; non-homes before ``homes``; fewer streams first (an unsaid
    count between idle and busy); ties in a random order (``rng``), else as given."""
    listed = list(holders)
    home = set(homes)
    order = {h.address: rng.random() if rng is not None else i for i, h in enumerate(listed)}

    def key(h: Holder) -> tuple:
        streams = h.streams if h.streams >= 0 else BUSY_STREAMS / 2
        return (not h.complete, streams >= BUSY_STREAMS, h.address in home, streams, order[h.address])

    return sorted(listed, key=key)
