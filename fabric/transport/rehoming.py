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

__all__ = ["announcements", "pushes"]


def pushes(held: Sequence[str], before: Fleet, after: Fleet, me: str | None, k: int) -> dict[str, list[str]]:
    """adapter id -> the new homes this node (``me``) pushes it to, for the ids of ``held`` whose homes changed."""
    if me is None or not held:
        return {}
    old = before.homes_of_many(held, k)
    new = after.homes_of_many(held, k)
    plan: dict[str, list[str]] = {}
    for adapter_id, was, now in zip(held, old, new, strict=False):
        arrivals = [m for m in now if m not in was and m != me]
        if not arrivals:
            continue
        if me in was or not any(m in after for m in was):
            plan[adapter_id] = arrivals
    return plan


def announcements(held: Sequence[str], before: Fleet, after: Fleet, me: str | None, k: int) -> dict[str, list[str]]:
    """adapter id -> the homes this node (``me``) tells it holds a copy, for the ids of ``held`` whose homes changed and
    whose home this node is not (any more)."""
    if me is None or not held:
        return {}
    plan: dict[str, list[str]] = {}
    for adapter_id, was, now in zip(held, before.homes_of_many(held, k), after.homes_of_many(held, k), strict=True):
        if me in now or set(was) == set(now):
            continue
        told = now if me in was else [m for m in now if m not in was]
        if told:
            plan[adapter_id] = told
    return plan
