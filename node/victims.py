"""What an eviction may choose from: one candidate per digest the store holds, with what holds it, and whether peers hold copies.

``Candidates`` reads the store (sizes from per-digest summaries, no manifest
per adapter) and names what holds each digest: an operator's keep, a slot it
is resident in, a Fetch serving it or a promote pulling or loading it
(``InUse``), or an engine beside the node that registered it. The choice
itself is pure (``adapter_fabric.store.eviction.choose_victims``).

``CopiesElsewhere`` asks the known peers, all at once, whether they hold a
complete copy of each victim (Availability, as Locate does), each ask bounded
by ``ASK_TIMEOUT_S``: a silent peer costs one second in all, not five per
victim. A victim no peer answers a complete copy of is a last copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from adapter_fabric.errors import FabricError
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.in_use import InUse
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import IN_USE, KEPT, RESIDENT, Candidate
from adapter_fabric.transport import peer_calls
from adapter_fabric.transport.channels import PeerChannels

#: seconds each peer gets to say whether it holds a complete copy of a victim
ASK_TIMEOUT_S = 1.0
#: Availability asks in flight at once, whatever the number of victims and peers
MAX_ASKS = 16


class Candidates:
    """One ``Candidate`` per digest held, with its most recent use and what holds it ("" for nothing)."""

    def __init__(self, store: AdapterStore, in_use: InUse, resident: Callable[[], set[str]], engines: EngineViews | None = None) -> None:
        self.store = store
        self.in_use = in_use
        #: the digests resident in a slot (a store-only node has none)
        self.resident = resident
        #: what the engines beside the node registered (--engine-url): held
        self.engines = engines

    def __call__(self) -> list[Candidate]:
        resident = self.resident()
        by_digest: dict[str, list] = {}
        for held in self.store.held():
            by_digest.setdefault(held.digest, []).append(held)
        return [
            Candidate(digest, tuple(h.adapter_id for h in ids), ids[0].size, max(h.last_used for h in ids), self._holder(digest, ids, resident))
            for digest, ids in by_digest.items()
        ]

    def _holder(self, digest: str, held: list, resident: set[str]) -> str:
        if any(h.kept for h in held):
            return KEPT
        if digest in resident:
            return RESIDENT
        ids = [h.adapter_id for h in held]
        if digest in self.in_use or any(i in self.in_use for i in ids):
            return IN_USE
        return self.engines.hold(ids) if self.engines is not None else ""


class CopiesElsewhere:
    """Which digests no known peer holds a complete copy of, asked of every peer at once."""

    def __init__(self, channels: PeerChannels, peers: Callable[[], list[str]], timeout: float = ASK_TIMEOUT_S) -> None:
        self.channels = channels
        self.peers = peers
        self.timeout = timeout

    def last_copies(self, digests: Iterable[str]) -> set[str]:
        """The digests of ``digests`` no known peer answered a complete copy of (every one, with no peers)."""
        wanted = sorted(set(digests))
        peers = self.peers()
        if not wanted or not peers:
            return set(wanted)
        asks = [(digest, peer) for digest in wanted for peer in peers]
        with ThreadPoolExecutor(max_workers=min(MAX_ASKS, len(asks)), thread_name_prefix="evict-ask") as pool:
            answers = list(pool.map(lambda ask: self._complete(*ask), asks))
        elsewhere = {digest for (digest, _), complete in zip(asks, answers, strict=True) if complete}
        return set(wanted) - elsewhere

    def _complete(self, digest: str, peer: str) -> bool:
        try:
            return peer_calls.holding(self.channels, peer, digest, timeout=self.timeout).complete
        except FabricError:
            return False  # silent, refusing or unknown: not a copy anyone can count on
