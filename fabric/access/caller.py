"""The principal of the call being served, for the code behind the service edge (listings filter by it).

The node's access gate (``adapter_fabric.node.gate``) sets it for each call it admits; a node
without a policy never sets it, and every call is then the cluster principal,
as before policies.
"""

from __future__ import annotations

from contextvars import ContextVar

from adapter_fabric.access.policy import CLUSTER, Principal

_CALLER: ContextVar[Principal] = ContextVar("fabric_caller", default=CLUSTER)


def caller() -> Principal:
    """The principal the current call runs as (``CLUSTER`` where no policy is set)."""
    return _CALLER.get()


def set_caller(principal: Principal) -> None:
    """Run the rest of the current call (its asyncio task) as ``principal``."""
    _CALLER.set(principal)
