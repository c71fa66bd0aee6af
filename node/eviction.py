"""The evicting node: a service that makes room in the store outside every store lock (--when-full evict, the default).

The store's own rule at its limit is local: a writer that would pass
--max-store-bytes is refused (``StoreFull``) before a byte is written. The
node then asks the ``Evictor`` for room (``make_room``) off every store lock
and opens the writer again (``adapter_fabric.store.quota.opened_with_room``).

One worker thread evicts, one round at a time (two would pick the same
victims). A round runs when a writer waits for room, and in the background
once the store passes its high-water mark (halfway from --evict-to to the
limit), so commits rarely wait. A round chooses the least recently used free
adapters down to --evict-to of the limit (``choose_victims``, pure), asks the
peers at once which victims are copies they hold (``CopiesElsewhere``), unloads
the victims from a driven SGLang, and drops them through the store's own
verb (``AdapterStore.evict``). A victim that is a last copy is never on a
writer's path: it is queued for a hand-off to a durable peer (with placement, to one of its homes)
(``adapter_fabric.node.handoff.HandOffs``), held meanwhile, and the round
chooses around it.

A writer waits at most ``ROOM_WAIT_S``: it gets its room, the round's
refusal naming what holds the rest, or a refusal saying what is under way
(hand-offs, and for how long) and to retry. No writer ever hears another
call's peer error: a hand-off's or an engine's failure is the worker's to log.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adapter_fabric.errors import QuotaExceeded, StoreFull
from adapter_fabric.node.handoff import HANDOFF_TIMEOUT_S, HandOffs
from adapter_fabric.node.victims import Candidates, CopiesElsewhere
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import LAST_COPY, Candidate, choose_victims

if TYPE_CHECKING:
    from adapter_fabric.node.engine_drive import SGLangDrive
    from adapter_fabric.node.engines import EngineViews

log = logging.getLogger("fabric.node")

#: evictions StoreStatus lists (the count covers all of them)
RECENT_EVICTIONS = 20
#: seconds a writer waits for room before it is refused, naming what is under way
ROOM_WAIT_S = 5.0
#: seconds between two background looks at the store's usage (a few stats each: ``Quota.usage``)
TICK_S = 1.0
#: what holds a last copy while a durable peer pulls it
HANDING_OFF = "a last copy being handed to a durable peer"


def high_water(low_water: float) -> float:
    """The share of the limit past which the node evicts in the background: halfway from ``low_water`` to the limit."""
    return low_water + (1.0 - low_water) / 2


@dataclass
class _Demand:
    """A writer waiting for room: its bytes, itself in words, and what the last round that counted it answered."""

    needed: int
    what: str
    #: why the last round could not make the room ("" when it did, or none ran yet)
    refusal: str = ""
    #: a round made the room: later rounds no longer count it (its writer may be filling that room already)
    served: bool = False


class RefuseRoom:
    """A durable node's answer to a full store (--when-full refuse): never evicts; the refusal says why."""

    def __init__(self, why: str) -> None:
        self.why = why
        #: adapters evicted since start, for StoreStatus: always 0 here
        self.evictions = 0

    def make_room(self, full: StoreFull) -> None:
        raise QuotaExceeded(f"{full}; {self.why}")


class Evictor:
    """Makes room in the store by dropping cold adapters, on its own thread, outside every store lock."""

    def __init__(
        self,
        store: AdapterStore,
        candidates: Candidates,
        low_water: float,
        copies: CopiesElsewhere | None = None,
        hand_off: Callable[[Candidate], bool] | None = None,
        engines: EngineViews | None = None,
        drive: SGLangDrive | None = None,
        room_wait: float = ROOM_WAIT_S,
        hands_to: str = "a durable peer",
    ) -> None:
        """``low_water``: the share of the limit a round frees down to (--evict-to). ``copies``: which victims are last copies (None: none is; no peers to lose it to). ``hand_off``: has a durable peer
        take a last copy, true once one holds it (None: last copies stay). ``engines`` are read afresh before each round;
        a driven SGLang (``drive``) unloads each victim before its directory goes."""
        self.store = store
        self.candidates = candidates
        self.copies = copies
        self.low_water = low_water
        self.high_water = high_water(low_water)
        self.engines = engines
        self.drive = drive
        self.room_wait = room_wait
        #: who takes last copies, in words: "a durable peer", or with placement "a home"
        self.hands_to = hands_to
        self.handing_off_reason = HANDING_OFF.replace("a durable peer", hands_to)
        #: adapters (digests) evicted since the node started, for StoreStatus
        self.evictions = 0
        #: the latest evictions, newest last, for StoreStatus (fabric store-status shows them): (ids, digest, bytes, time, reason)
        self.recent: deque[tuple[tuple[str, ...], str, int, float, str]] = deque(maxlen=RECENT_EVICTIONS)
        self.hand_offs = HandOffs(hand_off, self._hand_off_ended) if hand_off is not None else None
        self._cond = threading.Condition()  # guards _demands, _woken, _stopped; never held across a round
        self._demands: list[_Demand] = []
        self._woken = False
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="evictor", daemon=True)

    def start(self) -> Evictor:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop after the round under way (queued hand-offs are dropped: their copies stay)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self.hand_offs is not None:
            self.hand_offs.close()

    # ------------------------------------------------------------ writers

    def make_room(self, full: StoreFull) -> None:
        """Wait (at most ``room_wait`` seconds) until ``full.needed`` more bytes fit, or raise ``QuotaExceeded`` naming why not.

        Called by a writer the store refused, on an I/O thread holding no store lock.
        """
        limit = self.store.max_bytes
        if limit is None:
            return
        deadline = time.monotonic() + self.room_wait
        demand = _Demand(full.needed, full.what)
        with self._cond:
            self._demands.append(demand)
            self._woken = True
            self._cond.notify_all()
            try:
                while True:
                    if self.store.usage() + demand.needed <= limit:
                        return
                    if demand.served:  # room was made, and another writer took it first: ask for a round again
                        demand.served = False
                        self._woken = True
                        self._cond.notify_all()
                    elif demand.refusal and not self._handing_off():
                        raise QuotaExceeded(demand.refusal)
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopped:
                        raise QuotaExceeded(self._under_way(full))
                    self._cond.wait(left)
            finally:
                self._demands.remove(demand)

    def _handing_off(self) -> bool:
        return self.hand_offs is not None and bool(self.hand_offs.running())

    def _under_way(self, full: StoreFull) -> str:
        """The refusal of a writer whose wait ran out: what the eviction is doing, and when to retry."""
        running = self.hand_offs.running() if self.hand_offs is not None else []
        if running:
            oldest = running[0]
            doing = (
                f"handing {len(running)} last cop{'y' if len(running) == 1 else 'ies'} to {self.hands_to} first "
                f"({', '.join(repr(r.victim.ids[0]) for r in running[:3])}{', ...' if len(running) > 3 else ''}; the oldest for "
                f"{time.monotonic() - oldest.since:.0f}s, at most {HANDOFF_TIMEOUT_S:.0f}s)"
            )
        else:
            doing = "still choosing what to drop"
        return f"{full}; the node is making room, {doing}, and none was free within {self.room_wait:g}s: retry in a few seconds"

    # ------------------------------------------------------------ the worker

    def _hand_off_ended(self) -> None:
        """A hand-off ended: what the rounds answered while it ran is stale (a last copy may go now, or is held): choose again."""
        with self._cond:
            for demand in self._demands:
                demand.refusal = ""
            self._woken = True
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._woken and not self._stopped:
                    self._cond.wait(TICK_S)
                if self._stopped:
                    return
                self._woken = False
                demands = [d for d in self._demands if not d.served]  # a served writer's bytes are in the usage already, or soon
            try:
                refusal = self._round(demands)
            except Exception as exc:  # noqa: BLE001 (the worker lives on: the waiting writers hear why, and the next round tries again)
                log.exception("an eviction round failed")
                refusal = f"the eviction failed: {exc}"
            with self._cond:
                for demand in demands:
                    demand.refusal, demand.served = refusal, not refusal
                self._cond.notify_all()

    def _round(self, demands: list[_Demand]) -> str:
        """One eviction for ``demands`` (none: a background round past the high-water mark); the refusal, "" when room was
        made or none was needed."""
        limit = self.store.max_bytes
        if limit is None:
            return ""
        needed = sum(d.needed for d in demands)
        used = self.store.usage()
        if used + needed <= (limit if demands else int(limit * self.high_water)):
            return ""
        what = demands[0].what if len(demands) == 1 else f"{len(demands)} writers" if demands else "keeping the store under its high-water mark"
        # The drive paused throughout: no load may come between a victim's unload and its directory going (invariant 14).
        with self.drive.paused() if self.drive is not None else nullcontext():
            if self.engines is not None:
                self.engines.refresh()  # a registration a moment ago counts
            candidates = [self._while_handed_off(c) for c in self.candidates()]
            while True:
                try:
                    victims = choose_victims(candidates, needed, used, limit, self.low_water, what)
                except QuotaExceeded as refused:
                    return str(refused)
                held = self._last_copies(victims) or self._not_unloaded(victims)
                if not held:
                    self._drop(victims, what)
                    return ""
                # Each pass holds one more candidate at least, so the passes end.
                candidates = [dataclasses.replace(c, held=held[c.digest]) if c.digest in held else c for c in candidates]

    def _while_handed_off(self, candidate: Candidate) -> Candidate:
        """A candidate a hand-off is moving, or that no durable peer took lately, is held as such."""
        if self.hand_offs is None or candidate.held:
            return candidate
        if any(r.victim.digest == candidate.digest for r in self.hand_offs.running()):
            return dataclasses.replace(candidate, held=self.handing_off_reason)
        if self.hand_offs.refused_lately(candidate.digest):
            return dataclasses.replace(candidate, held=LAST_COPY)
        return candidate

    def _last_copies(self, victims: list[Candidate]) -> dict[str, str]:
        """The victims no peer holds a complete copy of, each queued for a hand-off: digest -> what holds it now."""
        if self.copies is None or not victims:
            return {}
        last = self.copies.last_copies(victims)
        held = {}
        for victim in victims:
            if victim.digest in last:
                queued = self.hand_offs is not None and self.hand_offs.submit(victim)
                held[victim.digest] = self.handing_off_reason if queued else LAST_COPY
        return held

    def _not_unloaded(self, victims: list[Candidate]) -> dict[str, str]:
        """Unload ``victims`` from the driven SGLang; digest -> what holds it, for each it did not unload."""
        if self.drive is None:
            return {}
        refused = self.drive.release([i for v in victims for i in v.ids])
        return {v.digest: next(refused[i] for i in v.ids if i in refused) for v in victims if any(i in refused for i in v.ids)}

    def _drop(self, victims: list[Candidate], what: str) -> None:
        """Drop each victim's ids (each only while it still names the victim's digest)."""
        for victim in victims:
            gone = [adapter_id for adapter_id in victim.ids if self.store.evict(adapter_id, victim.digest)]
            if not gone:
                continue  # unstaged or restaged meanwhile: nothing of it to drop
            self.evictions += 1
            self.recent.append((tuple(gone), victim.digest, victim.size, time.time(), what))
            metrics.EVICTIONS.inc()
            metrics.EVICTED_BYTES.inc(victim.size)
            event(log, "evicted a cold adapter", adapter=",".join(gone), digest=victim.digest, bytes=victim.size, reason=what)
