"""What a pull made for a caller may take: the caller's own grants, wherever the bytes come from (invariant 18).

docs/ARCHITECTURE.md, "Authority travels with the request". Used by every path that brings bytes under an id
for a caller: a Promote or pull naming a peer (``node.promotes``) and one naming none (``node.origin_fetch``).
"""

from __future__ import annotations

from collections.abc import Callable

from adapter_fabric.access.policy import Principal, identity_of
from adapter_fabric.store import AdapterStore


def may_reuse(who: Principal, store: AdapterStore) -> Callable[[str], bool] | None:
    """Whether bytes of a digest held here may go under a new id for ``who`` without moving: only when it may ``pull`` an id
    that refers to them here (None: always, for a caller that may pull everywhere). The ids' scan is O(refs): ask it
    only when bytes of the digest are here."""
    if who.may_everywhere("pull"):
        return None
    return lambda digest: any(who.allows("pull", i) for i in store.ids_of(digest))


def pull_authority(who: Principal, store: AdapterStore) -> dict:
    """``PeerPuller.pull``'s ``behalf`` and ``may_reuse`` for a pull made for ``who``:

    - its peer calls name ``who`` (``identity_of``), so every holder gives only what ``who`` may pull there;
    - bytes this node holds already go under the new id without moving only as ``may_reuse`` says; otherwise the peers
      must send them again, each chunk verified, as a proof that they hold them.

    The cluster principal (no policy, or the node's own --auth-token-file) pulls as the node itself, as before.
    """
    reuse = may_reuse(who, store)
    return {"behalf": identity_of(who)} if reuse is None else {"behalf": identity_of(who), "may_reuse": reuse}
