"""Talking to nodes: the blocking ``NodeClient`` and multi-node ``rollout``."""

from fabric.client.node_client import GenerateResult, NodeClient
from fabric.client.rollout import NodeRollout, rollout

__all__ = ["GenerateResult", "NodeClient", "NodeRollout", "rollout"]
