"""The LRU choice of a cache store: which cold adapters go so that a commit fits, or why none can.

Pure: handed what the store holds (one ``Candidate`` per digest, with its
recency, what holds it, if anything, and whether this node is one of its homes),
it answers the victims, copies this node is no home of first, each kind least
recently used first, down to a low-water mark below the limit; it removes
nothing itself (``adapter_fabric.node.eviction`` does, through the store's own paths).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from adapter_fabric.errors import QuotaExceeded

#: what may hold an adapter in the store (never dropped while it does)
KEPT, RESIDENT, IN_USE = "kept by an operator", "resident in a slot", "in use (being served or pulled)"
LAST_COPY = "the last complete copy among the known peers"
#: templates, filled with the engine's host:port
ENGINE = "registered by engine {} (its GET /v1/models names it)"
ENGINE_UNKNOWN = "exported while engine {} has not answered GET /v1/models (what it may read is unknown)"
#: filled with the engine's host:port and why its list was cut
ENGINE_CUT = "exported while engine {}'s GET /v1/models list is cut ({}): what it may read is unknown"
#: a driven engine (--sglang-url) that did not unload an adapter before its eviction
ENGINE_NOT_UNLOADED = "loaded in engine {}, which did not unload it"
#: a driven engine the node is loading the adapter into right now (the eviction does not wait for the load)
ENGINE_LOADING = "being loaded into engine {} right now"


@dataclass(frozen=True)
class Candidate:
    """One digest the store holds: the ids referring to it, its bytes, when it was last used, and what holds it ("" for nothing)."""

    digest: str
    ids: tuple[str, ...]
    size: int
    last_used: float
    held: str = ""
    #: whether this node is one of its homes (``adapter_fabric.transport.placement``): non-home copies go first
    home: bool = False


def choose_victims(candidates: list[Candidate], needed: int, used: int, limit: int, low_water: float, what: str) -> list[Candidate]:
    """The cold candidates to drop, non-home copies first, each kind least recently used first, until ``used + needed`` is
    at most ``low_water * limit``.

    Fewer when the free ones run out but the commit fits the limit itself; none, and ``QuotaExceeded`` naming what holds
    the rest, when even dropping every free candidate would not make it fit (nothing is dropped for a refusal).
    """
    target = min(limit, int(limit * low_water))
    free = sorted((c for c in candidates if not c.held), key=lambda c: (c.home, c.last_used, c.digest))
    victims: list[Candidate] = []
    left = used
    for candidate in free:
        if left + needed <= target:
            break
        victims.append(candidate)
        left -= candidate.size
    if left + needed > limit:
        raise QuotaExceeded(refusal(candidates, needed, used, limit, what, left))
    return victims


def refusal(candidates: list[Candidate], needed: int, used: int, limit: int, what: str, after: int) -> str:
    """Why no room can be made: the adapters held, counted by what holds them, each with what would let them go."""
    from adapter_fabric.store.quota import quota_exceeded  # the one wording of a store's QuotaExceeded

    held = Counter(c.held for c in candidates if c.held)
    phrases = [f"{n} adapter{' is' if n == 1 else 's are'} {_plural(reason, n)}: {_frees(reason)}" for reason, n in sorted(held.items())]
    return str(quota_exceeded(needed, used, limit, what, held="; ".join(phrases) or "nothing (no adapters to drop)", after=after))


def _plural(reason: str, n: int) -> str:
    return reason.replace("copy", "copies") if n > 1 and reason == LAST_COPY else reason


def _frees(reason: str) -> str:
    """What lets an adapter held for ``reason`` go (an engine's hold is not an operator's unkeep or unstage)."""
    hints = {
        KEPT: "fabric keep NODE --id ID --unkeep lets one go",
        RESIDENT: "it may go once another adapter is promoted into its slot",
        IN_USE: "it may go once that ends",
        LAST_COPY: "a durable peer (--when-full refuse) in --peers takes a last copy first",
    }
    if reason in hints:
        return hints[reason]
    head, _, tail = ENGINE_UNKNOWN.partition("{}")
    if reason.startswith(head) and reason.endswith(tail):
        return "once the engine answers, only what it lists is held"
    if any(reason.startswith(template.partition("{}")[0]) for template in (ENGINE, ENGINE_NOT_UNLOADED)):
        return "unload it in the engine first"
    return "it may go once that is done"  # a hold the node names itself (a hand-off under way)
