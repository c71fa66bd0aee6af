"""The evicting store: when a commit would pass --max-store-bytes, cold adapters go first (least recently used).

``EvictWhenFull`` is the store's ``WhenFull`` policy on a node started with
--when-full evict (the default). The choice is pure (``adapter_fabric.store.eviction``);
here is what holds an adapter: an operator's keep (``fabric keep``), a slot
it is resident in, and a Fetch serving it or a promote pulling or loading it
(``InUse``), an engine beside the node that registered it (``adapter_fabric.node.engines``), a driven SGLang
that would not unload it first (``adapter_fabric.node.engine_drive``), and being
the last complete copy the known peers answer for (``CopiesElsewhere``) unless a durable peer took it
first (``adapter_fabric.node.handoff``).
The store's quota measures again after the victims went.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Iterator

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import IN_USE, KEPT, LAST_COPY, RESIDENT, Candidate, choose_victims
from adapter_fabric.transport.pull import PeerPuller
from adapter_fabric.node.engines import EngineViews

if TYPE_CHECKING:
    from adapter_fabric.node.engine_drive import SGLangDrive

log = logging.getLogger("fabric.node")

#: evictions StoreStatus lists (the count covers all of them)
RECENT_EVICTIONS = 20
#: what an eviction frees down to, as a share of --max-store-bytes (--evict-to): room for the next few commits without evicting again
LOW_WATER = 0.9


class InUse:
    """Adapter ids and digests being served, pulled or loaded right now (counted: several may use one at once)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # taken on the event loop and on I/O threads

    @contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        """Count ``keys`` (ids or digests) in use until the block ends."""
        with self._lock:
            self._counts.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._counts.subtract(keys)
                for key in keys:
                    if self._counts[key] <= 0:
                        del self._counts[key]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return self._counts[key] > 0


class CopiesElsewhere:
    """Whether a known peer holds a complete copy of a digest (asked through Availability, as Locate does)."""

    def __init__(self, puller: PeerPuller, peers: Callable[[], list[str]]) -> None:
        self.puller = puller
        self.peers = peers

    def __call__(self, digest: str) -> bool:
        for peer in self.peers():
            holding = self.puller.availability(peer, digest)  # None when it holds nothing or does not answer
            if holding is not None and holding.complete:
                return True
        return False


class EvictWhenFull:
    """Drops cold adapters, least recently used first, down to ``low_water`` of the limit; refuses naming what holds the rest."""

    def __init__(
        self,
        store: AdapterStore,
        in_use: InUse,
        resident: Callable[[], set[str]] = set,
        elsewhere: Callable[[str], bool] | None = None,
        hand_off: Callable[[Candidate], bool] | None = None,
        low_water: float = LOW_WATER,
        engines: EngineViews | None = None,
        drive: SGLangDrive | None = None,
    ) -> None:
        self.store = store
        #: the driven SGLang (--sglang-url): each victim is unloaded from it before its export directory goes
        self.drive = drive
        #: what the engines beside the node registered (--engine-url): held; read afresh before each choice
        self.engines = engines
        self.in_use = in_use
        #: whether another complete copy answers (``CopiesElsewhere``); None: every adapter may go (no peers to ask)
        self.elsewhere = elsewhere
        #: has a durable peer take a last copy (``adapter_fabric.node.handoff.HandOff``), true once one holds it; None: last copies stay
        self.hand_off = hand_off
        #: the share of the limit an eviction frees down to (--evict-to)
        self.low_water = low_water
        #: the digests resident in a slot (set by the node once its promotes exist)
        self.resident = resident
        #: adapters (digests) evicted since the node started, for StoreStatus
        self.evictions = 0
        #: the latest evictions, newest last, for StoreStatus (fabric store-status shows them): (ids, digest, bytes, time, reason)
        self.recent: deque[tuple[tuple[str, ...], str, int, float, str]] = deque(maxlen=RECENT_EVICTIONS)
        self._lock = threading.Lock()  # one eviction at a time: two would pick the same victims

    def make_room(self, needed: int, used: int, limit: int, what: str) -> None:
        """Free room for ``needed`` bytes by dropping cold adapters, or raise ``QuotaExceeded`` naming why none can go."""
        # The drive paused throughout: no load may come between a victim's unload and its directory going (invariant 14).
        with self._lock, self.drive.paused() if self.drive is not None else nullcontext():
            used = self.store.usage()  # another eviction may have freed room meanwhile
            if used + needed <= limit:
                return
            victims = self._choose(needed, used, limit, what)
            for victim in victims:
                for adapter_id in victim.ids:
                    try:
                        self.store.unstage(adapter_id)
                    except AdapterNotFound:
                        pass  # unstaged by hand meanwhile
                self.evictions += 1
                self.recent.append((victim.ids, victim.digest, victim.size, time.time(), what))
                metrics.EVICTIONS.inc()
                metrics.EVICTED_BYTES.inc(victim.size)
                event(log, "evicted a cold adapter", adapter=",".join(victim.ids), digest=victim.digest, bytes=victim.size, reason=what)

    def _choose(self, needed: int, used: int, limit: int, what: str) -> list[Candidate]:
        """The LRU victims, none of them the last complete copy the known peers answer for, unless a durable peer took it
        first (a last copy no durable peer takes is held, and the choice made again)."""
        if self.engines is not None:
            self.engines.refresh()  # a registration a moment ago counts: one local HTTP read per eviction
        candidates = self._candidates()
        while True:
            victims = choose_victims(candidates, needed, used, limit, self.low_water, what)
            last = {v.digest for v in victims if self.elsewhere is not None and not self.elsewhere(v.digest) and not self._handed_off(v)}
            held = dict.fromkeys(last, LAST_COPY) if last else self._unloaded(victims)
            if not held:
                return victims
            # Each round holds one more candidate at least, so the rounds end.
            candidates = [dataclasses.replace(c, held=held[c.digest]) if c.digest in held else c for c in candidates]

    def _unloaded(self, victims: list[Candidate]) -> dict[str, str]:
        """Unload ``victims`` from the driven SGLang; digest -> what holds it, for each it did not unload."""
        if self.drive is None:
            return {}
        refused = self.drive.release([i for v in victims for i in v.ids])
        return {v.digest: next(refused[i] for i in v.ids if i in refused) for v in victims if any(i in refused for i in v.ids)}

    def _handed_off(self, victim: Candidate) -> bool:
        """Whether a durable peer pulled ``victim`` from here just now (asked only for a last copy)."""
        return self.hand_off is not None and self.hand_off(victim)

    def _candidates(self) -> list[Candidate]:
        """One candidate per digest held, with its most recent use and what holds it."""
        resident = self.resident()
        ids: dict[str, list[str]] = {}
        sizes: dict[str, int] = {}
        for adapter_id, digest, size in self.store.held():  # sizes from summaries: no manifest per adapter held
            ids.setdefault(digest, []).append(adapter_id)
            sizes[digest] = size
        return [
            Candidate(digest, tuple(names), sizes[digest], max(self.store.recency.last_used(i) for i in names), self._held(digest, names, resident))
            for digest, names in ids.items()
        ]

    def _held(self, digest: str, ids: list[str], resident: set[str]) -> str:
        if any(i in self.store.kept for i in ids):
            return KEPT
        if digest in resident:
            return RESIDENT
        if digest in self.in_use or any(i in self.in_use for i in ids):
            return IN_USE
        return self.engines.hold(ids) if self.engines is not None else ""
