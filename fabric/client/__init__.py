"""Talking to nodes: the blocking ``NodeClient``, its result types, and multi-node ``rollout``."""

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.client.results import (
    ActiveSlot,
    Availability,
    GenerateResult,
    Identity,
    Listing,
    Location,
    PeerHolding,
    PeftSummary,
    PromoteResult,
    SlotInfo,
    StagedAdapter,
    StageResult,
    StoreStatus,
)
from adapter_fabric.client.rollout import NodeRollout, rollout

__all__ = [
    "ActiveSlot",
    "Availability",
    "GenerateResult",
    "Identity",
    "Listing",
    "Location",
    "NodeClient",
    "NodeRollout",
    "PeerHolding",
    "PeftSummary",
    "PromoteResult",
    "SlotInfo",
    "StageResult",
    "StagedAdapter",
    "StoreStatus",
    "rollout",
]
