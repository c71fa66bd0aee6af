"""Talking to nodes: the blocking ``NodeClient``, its result types, and multi-node ``rollout``."""

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.client.results import (
    ActiveSlot,
    Availability,
    GenerateResult,
    Listing,
    Location,
    PeerHolding,
    PeftSummary,
    PromoteResult,
    SlotInfo,
    StagedAdapter,
    StageResult,
)
from adapter_fabric.client.rollout import NodeRollout, rollout

__all__ = [
    "ActiveSlot",
    "Availability",
    "GenerateResult",
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
    "rollout",
]
