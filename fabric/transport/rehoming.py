"""Re-homing after the members change: which of this node's adapters it pushes to which new homes. Pure.

When a member joins it takes about ``1/n`` of all homes; when one leaves its homes go to the next ranks. For each
adapter a node holds, the new homes that were not homes before (``arrivals``) need a copy. Each former home that is
still a member and holds a copy pushes it (at most ``k``: eviction may have dropped a home copy another home held,
so no single one is sure to hold it), or, when every former home left at once, each node that still holds a copy.
The arrival pulls each digest once: concurrent pushes join one download, later ones find it held and move no byte.
A former home that is no longer one keeps its copy as an ordinary, non-home copy: eviction drops such copies first,
and never a last copy (``adapter_fabric.node.eviction``).
"""

from __future__ import annotations

from collections.abc import Sequence

from adapter_fabric.transport.placement import Fleet

__all__ = ["pushes"]


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
