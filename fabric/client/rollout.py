"""Promote one adapter on many nodes at once, and time each node.

All nodes are asked at the same moment; each pulls from the seed and from
every peer it knows (the swarm), so nodes that started receiving serve their
verified chunks to the others. Used by ``fabric rollout`` and the swarm
benchmark.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from adapter_fabric.errors import FabricError

if TYPE_CHECKING:
    from adapter_fabric.client.node_client import NodeClient


@dataclass
class NodeRollout:
    """One node's part of a rollout; ``seconds`` counts from the common start to its reply."""

    node: str
    ok: bool
    seconds: float
    error: str = ""
    retryable: bool = False
    slot: int = -1
    digest: str = ""
    bytes_transferred: int = 0
    pull_seconds: float = 0.0
    source_peers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A JSON-ready dict of this node's outcome."""
        return asdict(self)


def rollout(
    nodes: Sequence[str],
    adapter_id: str,
    seed: str,
    *,
    name: str = "",
    stage_only: bool = False,
    named_peer_only: bool = False,
    client_for: Callable[[str], NodeClient] | None = None,
    on_done: Callable[[NodeRollout], None] | None = None,
) -> list[NodeRollout]:
    """Promote ``adapter_id`` from ``seed`` on every node in ``nodes`` in parallel; results in ``nodes`` order.

    ``stage_only`` pulls into the store without loading a slot (store-only
    nodes accept only that); ``named_peer_only`` makes every node pull from
    the seed alone (the star baseline). ``client_for(address)`` makes a
    NodeClient-like object (default: a plain NodeClient); a failure on one
    node is reported in its result, not raised. ``on_done(result)`` is called
    as each node finishes (from that node's thread), for progress lines.
    """
    if client_for is None:
        from adapter_fabric.client.node_client import NodeClient

        client_for = NodeClient
    clients = [client_for(node) for node in nodes]
    start = threading.Barrier(len(nodes) + 1)
    t0 = 0.0

    def one(index: int) -> NodeRollout:
        result = attempt(index)
        if on_done is not None:
            on_done(result)
        return result

    def attempt(index: int) -> NodeRollout:
        client, node = clients[index], nodes[index]
        start.wait()
        try:
            reply = client.promote(adapter_id, peer=seed, name=name, stage_only=stage_only, named_peer_only=named_peer_only)
        except FabricError as exc:
            return NodeRollout(node=node, ok=False, seconds=time.monotonic() - t0, error=f"{type(exc).__name__}: {exc}", retryable=exc.retryable)
        return NodeRollout(
            node=node,
            ok=True,
            seconds=time.monotonic() - t0,
            slot=reply.slot,
            digest=reply.digest,
            bytes_transferred=reply.bytes_transferred,
            pull_seconds=reply.pull_seconds,
            source_peers=list(reply.source_peers),
        )

    try:
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            futures = [pool.submit(one, i) for i in range(len(nodes))]
            t0 = time.monotonic()
            start.wait()
            return [f.result() for f in futures]
    finally:
        for client in clients:
            client.close()
