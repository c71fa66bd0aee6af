"""Re-homing after the members change: which of this node's adapters it pushes to which new homes. Pure.

When a member joins it takes about ``1/n`` of all homes; when one leaves its homes go to the next ranks. For each
adapter a node holds, the new homes that were not homes before (``arrivals``) need a copy. Each former home that is
still a member and holds a copy pushes it (at most ``k``: eviction may have dropped a home copy another home held,
so no single one is sure to hold it), or, when every former home left at once, each node that still holds a copy.
The arrival pulls each digest once: concurrent pushes join one download, later ones find it held and move no byte.
A former home that is no longer one keeps its copy as an ordinary, non-home copy: eviction drops such copies first,
and never a last copy (``adapter_fabric.node.eviction``).

A node holding a copy of an id it is no home of after the change tells the homes that do not know of it yet
(``announcements``: an ``Announce`` each), so a lookup at the new homes names it at once rather than only after a
fan-out: a former home tells every home (its copy was a home's, in nobody's directory), any other holder only the
arrivals (the homes that stayed heard from it when it pulled).
"""

from __future__ import annotations

from collections.abc import Sequence

from adapter_fabric.transport.placement import Fleet

__all__ = ["Moved", "announcements", "moved", "plan", "pushes"]

#: an id whose homes changed: (adapter id, its homes before, its homes after)
Moved = tuple[str, list[str], list[str]]


def moved(held: Sequence[str], before: Fleet, after: Fleet, k: int) -> list[Moved]:
    """The ids of ``held`` whose homes changed, with both: each fleet's homes computed once, for both plans below."""
    old = before.homes_of_many(held, k)
    new = after.homes_of_many(held, k)
    # a member's score for an id is the same in every fleet, so the same homes come in the same order
    return [(i, was, now) for i, was, now in zip(held, old, new, strict=True) if was != now]


def plan(held: Sequence[str], before: Fleet, after: Fleet, me: str | None, k: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(``pushes``, ``announcements``) of one change, from one ``moved``."""
    if me is None or not held:
        return {}, {}
    changed = moved(held, before, after, k)
    return _pushes(changed, after, me), _announcements(changed, me)


def pushes(held: Sequence[str], before: Fleet, after: Fleet, me: str | None, k: int) -> dict[str, list[str]]:
    """adapter id -> the new homes this node (``me``) pushes it to, for the ids of ``held`` whose homes changed."""
    return plan(held, before, after, me, k)[0]


def announcements(held: Sequence[str], before: Fleet, after: Fleet, me: str | None, k: int) -> dict[str, list[str]]:
    """adapter id -> the homes this node (``me``) tells it holds a copy, for the ids of ``held`` whose homes changed and
    whose home this node is not (any more)."""
    return plan(held, before, after, me, k)[1]


def _pushes(changed: list[Moved], after: Fleet, me: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for adapter_id, was, now in changed:
        arrivals = [m for m in now if m not in was and m != me]
        if arrivals and (me in was or not any(m in after for m in was)):
            out[adapter_id] = arrivals
    return out


def _announcements(changed: list[Moved], me: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for adapter_id, was, now in changed:
        if me in now:
            continue
        told = now if me in was else [m for m in now if m not in was]
        if told:
            out[adapter_id] = told
    return out
