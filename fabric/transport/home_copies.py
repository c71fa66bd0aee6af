"""Eviction that knows placement: which victims are last copies, and which home each is handed to. Pure.

An evicting node asks only a victim's homes whether they hold a complete copy (not every peer: ``k`` asks, in
parallel, each bounded; ``adapter_fabric.node.victims``). Then, for each victim (``last_copies``):

- some other home holds it: an ordinary copy, it may go (non-home copies go first: ``store.eviction.choose_victims``);
- this node is a home and no other home holds it: the last home copy never goes; it is handed to the next live home
  (``LAST_HOME_COPY``) and stays until that home holds it;
- this node is no home and no home holds it: the last copy, handed to its first live home (not to any durable
  peer), held meanwhile (``store.eviction.LAST_COPY``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from adapter_fabric.store.eviction import LAST_COPY

__all__ = ["LAST_HOME_COPY", "Keep", "last_copies"]

#: what holds a victim this node is a home of while no other home holds it
LAST_HOME_COPY = "the last copy among its homes (this node is one)"


@dataclass(frozen=True)
class Keep:
    """A victim that stays: why (a store.eviction hold reason), and the home to hand it to (None: no live home to take it)."""

    why: str
    hand_to: str | None


def last_copies(
    victims: Sequence[str], homes: Mapping[str, Sequence[str]], copies: Mapping[str, Collection[str]], me: str | None, down: Collection[str] = ()
) -> dict[str, Keep]:
    """digest -> Keep, for the ``victims`` (digests) that may not go yet. ``homes``: each victim's homes in rank order
    (the union over its ids); ``copies``: the homes that answered a complete copy of it; ``down``: members skipped now."""
    kept: dict[str, Keep] = {}
    for digest in victims:
        if any(h != me for h in copies.get(digest, ())):
            continue
        ranked = homes.get(digest, ())
        hand_to = next((h for h in ranked if h != me and h not in down), None)
        kept[digest] = Keep(LAST_HOME_COPY if me is not None and me in ranked else LAST_COPY, hand_to)
    return kept
