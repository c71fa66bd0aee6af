"""What an eviction may choose from: one candidate per digest the store holds, with what holds it, and whether peers hold copies.

``Candidates`` reads the store (sizes from per-digest summaries, no manifest
per adapter) and names what holds each digest: an operator's keep, a slot it
is resident in, a Fetch serving it or a promote pulling or loading it
(``InUse``), or an engine beside the node that registered it. The choice
itself is pure (``adapter_fabric.store.eviction.choose_victims``).

``CopiesElsewhere`` asks the known peers, all at once, whether they hold a
complete copy of each victim (Availability, as Locate does), each ask bounded
by ``ASK_TIMEOUT_S``: a silent peer costs one second in all, not five per
victim. A victim no peer answers a complete copy of is a last copy. With
placement (``node.homes``) it asks only each victim's homes, and the rule is
``adapter_fabric.transport.home_copies.last_copies``: a victim no other home holds
is a last copy (this node being one of its homes or not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from adapter_fabric.errors import FabricError
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.in_use import InUse
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import IN_USE, KEPT, RESIDENT, Candidate
from adapter_fabric.store.held import HeldAdapter
from adapter_fabric.transport import peer_calls
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.home_copies import Keep, last_copies
from adapter_fabric.transport.members import MemberView


class Placement(Protocol):
    """What the copies' check needs of ``node.homes.Homes`` (named here, not imported: homes imports the hand-off, which
    imports this module)."""

    view: MemberView

    def homes_of(self, adapter_id: str) -> list[str]: ...

#: seconds each peer gets to say whether it holds a complete copy of a victim
ASK_TIMEOUT_S = 1.0
#: Availability asks in flight at once, whatever the number of victims and peers
MAX_ASKS = 16


class Candidates:
    """One ``Candidate`` per digest held, with its most recent use and what holds it ("" for nothing)."""

    def __init__(
        self, store: AdapterStore, in_use: InUse, resident: Callable[[], set[str]], engines: EngineViews | None = None,
        home_ids: Callable[[list[str]], set[str]] | None = None,
    ) -> None:  # fmt: skip
        """``home_ids``: which of the given ids this node is a home of (``Homes.home_ids``): their copies go last."""
        self.home_ids = home_ids
        self.store = store
        self.in_use = in_use
        #: the digests resident in a slot (a store-only node has none)
        self.resident = resident
        #: what the engines beside the node registered (--engine-url): held
        self.engines = engines

    def __call__(self) -> list[Candidate]:
        resident = self.resident()
        in_use = self.in_use.keys()
        by_digest: dict[str, list[HeldAdapter]] = {}
        held_ids = self.store.held()
        for held in held_ids:
            by_digest.setdefault(held.digest, []).append(held)
        homes = self.home_ids([h.adapter_id for h in held_ids]) if self.home_ids is not None else set()
        found = []
        for digest, held_here in by_digest.items():
            ids = tuple(h.adapter_id for h in held_here)
            holder = self._holder(digest, held_here, ids, resident, in_use)
            last_used = max(h.last_used for h in held_here)
            found.append(Candidate(digest, ids, held_here[0].size, last_used, holder, home=not homes.isdisjoint(ids)))
        return found

    def _holder(self, digest: str, held: list[HeldAdapter], ids: tuple[str, ...], resident: set[str], in_use: frozenset[str]) -> str:
        if any(h.kept for h in held):
            return KEPT
        if digest in resident:
            return RESIDENT
        if digest in in_use or not in_use.isdisjoint(ids):
            return IN_USE
        return self.engines.hold(list(ids)) if self.engines is not None else ""


class CopiesElsewhere:
    """Which victims no known peer (with placement: no other home) holds a complete copy of, all asked at once."""

    def __init__(
        self, channels: PeerChannels, peers: Callable[[], list[str]], timeout: float = ASK_TIMEOUT_S, homes: Placement | None = None,
        backed: Callable[[Candidate], bool] | None = None,
    ) -> None:  # fmt: skip
        """``backed``: whether a victim came from an origin that still holds it (never a last copy: a miss fetches it again)."""
        self.backed = backed
        self.channels = channels
        self.peers = peers
        self.timeout = timeout
        self.homes = homes

    def last_copies(self, victims: Iterable[Candidate]) -> set[str]:
        """The digests of ``victims`` no peer asked answered a complete copy of (every one, with no peers to ask)."""
        wanted = {v.digest: v for v in victims}
        if self.homes is not None:
            return set(self.kept(list(wanted.values())))
        peers = self.peers()
        if not wanted or not peers:
            return set(wanted)
        asks = [(digest, peer) for digest in sorted(wanted) for peer in peers]
        elsewhere = {digest for (digest, _), complete in zip(asks, self._ask(asks), strict=True) if complete}
        return set(wanted) - elsewhere

    def kept(self, victims: list[Candidate]) -> dict[str, Keep]:
        """With placement: the victims that may not go yet, and the home each is handed to (``home_copies.last_copies``)."""
        assert self.homes is not None
        me, down = self.homes.view.me, self.homes.view.down()
        victims = [v for v in victims if self.backed is None or not self.backed(v)]
        homes = {v.digest: list(dict.fromkeys(h for i in v.ids for h in self.homes.homes_of(i))) for v in victims}
        asks = [(digest, home) for digest, ranked in homes.items() for home in ranked if home != me and home not in down]
        copies: dict[str, set[str]] = {}
        for (digest, home), complete in zip(asks, self._ask(asks), strict=True):
            if complete:
                copies.setdefault(digest, set()).add(home)
        return last_copies(list(homes), homes, copies, me, down)

    def _ask(self, asks: list[tuple[str, str]]) -> list[bool]:
        if not asks:
            return []
        with ThreadPoolExecutor(max_workers=min(MAX_ASKS, len(asks)), thread_name_prefix="evict-ask") as pool:
            return list(pool.map(lambda ask: self._complete(*ask), asks))

    def _complete(self, digest: str, peer: str) -> bool:
        try:
            return peer_calls.holding(self.channels, peer, digest, timeout=self.timeout).complete
        except FabricError:
            return False  # silent, refusing or unknown: not a copy anyone can count on
