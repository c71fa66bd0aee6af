"""Handing a last copy to a durable peer before it is evicted (Kraken's origin tier).

A durable node (--when-full refuse) never evicts and says so in every
Availability reply. When the adapter an evicting node would drop is the last
complete copy its peers answer for, ``HandOff`` asks the known peers which are
durable and has the first that will pull it from this node (a stage-only
Promote naming this node alone), waiting at most ``HANDOFF_TIMEOUT_S``. Only a
pull that ended well lets the eviction drop its own copy; otherwise the
adapter stays, held as the last copy.
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

import grpc

from adapter_fabric.errors import FabricError
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store.eviction import Candidate
from adapter_fabric.transport import peer_calls
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.discovery import WILDCARD_HOSTS, split_host_port
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

log = logging.getLogger("fabric.node")

#: seconds a durable peer gets to pull one last copy before the eviction gives up on it (and keeps the adapter)
HANDOFF_TIMEOUT_S = 120.0


def dialable(me: str, toward: str) -> str:
    """This node's address as ``toward`` can dial it: ``me`` itself, or, when it listens on a wildcard host, the local
    address the route to ``toward`` leaves from (a UDP connect sends nothing)."""
    host, port = split_host_port(me)
    if host not in WILDCARD_HOSTS:
        return me
    peer_host, peer_port = split_host_port(toward)
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))
        local = probe.getsockname()[0]
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"


class HandOff:
    """Has a durable peer pull a last copy from this node; true only once one holds it."""

    def __init__(self, channels: PeerChannels, peers: Callable[[], list[str]], me: str, timeout: float = HANDOFF_TIMEOUT_S) -> None:
        self.channels = channels
        self.peers = peers
        #: the address this node serves on (``PeerSource.me``)
        self.me = me
        self.timeout = timeout

    def __call__(self, victim: Candidate) -> bool:
        """Whether a durable peer now holds ``victim`` (pulled from this node under its first id)."""
        durable = [peer for peer in self.peers() if peer_calls.is_durable(self.channels, peer)]
        for peer in durable:
            if self._pull_onto(peer, victim):
                metrics.HANDOFFS.labels("ok").inc()
                return True
        metrics.HANDOFFS.labels("none" if not durable else "refused").inc()
        if not durable:
            log.info("no durable peer answers: the last copy of %s stays", victim.digest)
        return False

    def _pull_onto(self, peer: str, victim: Candidate) -> bool:
        adapter_id = victim.ids[0]
        try:
            source = dialable(self.me, peer)
        except (OSError, FabricError) as exc:  # no route to it, or an address that is not HOST:PORT
            log.warning("cannot tell %s where to pull %s from: %s", peer, adapter_id, exc)
            return False
        request = fabric_pb2.PromoteRequest(peer=source, adapter_id=adapter_id, stage_only=True, named_peer_only=True)
        try:
            fabric_pb2_grpc.FabricStub(self.channels.get(peer)).Promote(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            log.warning("durable peer %s did not take the last copy of %s: %s", peer, adapter_id, error_from_rpc(exc, peer=peer))
            return False
        event(log, "handed a last copy to a durable peer", adapter=adapter_id, digest=victim.digest, peer=peer, bytes=victim.size)
        return True
