"""What a home knows of the other holders of its ids: who said they hold which digest, and when. Pure, bounded.

A node that pulled an adapter it is not a home of tells the id's homes (``Announce``); a home names those holders in
its answer to a lookup (``adapter_fabric.transport.lookup``), beside itself, so a miss reaches copies beyond the homes
and a hot adapter's homes are not its only seeds. The directory is soft state: an entry lives ``TTL_S`` unless said
again, a holder that drops the adapter says so, and one that is gone is skipped by the puller (it cannot serve what it
does not hold: every chunk is verified). Bounded: at most ``MAX_HOLDERS`` per id (the most recent) and ``MAX_IDS``
ids (the least recently told go first). No clock of its own: the caller passes ``now``; no lock: the caller's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["HolderDirectory", "Told", "MAX_HOLDERS", "MAX_IDS", "TTL_S"]

#: holders kept per id (the most recently told)
MAX_HOLDERS = 16
#: ids kept (the least recently told go first)
MAX_IDS = 100_000
#: seconds an entry is believed without being told again
TTL_S = 600.0


@dataclass(frozen=True)
class Told:
    """A holder's word: the digest it holds under the id, whether whole, and when it said so."""

    address: str
    digest: str
    complete: bool
    at: float


class HolderDirectory:
    """id -> the holders that told this home (bounded; see the module docstring)."""

    def __init__(self, max_ids: int = MAX_IDS, max_holders: int = MAX_HOLDERS, ttl: float = TTL_S) -> None:
        self.max_ids = max_ids
        self.max_holders = max_holders
        self.ttl = ttl
        self._ids: OrderedDict[str, OrderedDict[str, Told]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def told(self, adapter_id: str, address: str, digest: str, complete: bool, now: float) -> None:
        """``address`` holds ``digest`` under ``adapter_id`` (whole or in part) as of ``now``."""
        holders = self._ids.pop(adapter_id, None) or OrderedDict()
        holders.pop(address, None)
        holders[address] = Told(address, digest, complete, now)
        while len(holders) > self.max_holders:
            holders.popitem(last=False)
        self._ids[adapter_id] = holders  # most recently told last
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def dropped(self, adapter_id: str, address: str) -> None:
        """``address`` no longer holds ``adapter_id``."""
        holders = self._ids.get(adapter_id)
        if holders is not None:
            holders.pop(address, None)
            if not holders:
                del self._ids[adapter_id]

    def holders(self, adapter_id: str, now: float, digest: str = "") -> list[Told]:
        """Who holds ``adapter_id`` (of ``digest``, when given), most recently told first, entries past the TTL left out."""
        holders = self._ids.get(adapter_id)
        if not holders:
            return []
        fresh = [t for t in holders.values() if now - t.at < self.ttl]
        if len(fresh) < len(holders):
            for stale in [a for a, t in holders.items() if now - t.at >= self.ttl]:
                del holders[stale]
            if not holders:
                del self._ids[adapter_id]
        return [t for t in reversed(fresh) if not digest or t.digest == digest]
