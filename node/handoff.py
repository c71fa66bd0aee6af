"""Handing a last copy to a durable peer before it is evicted (Kraken's origin tier), in the background.

A durable node (--when-full refuse) never evicts and says so in every
Availability reply. When the adapter an evicting node would drop is the last
complete copy its peers answer for, the eviction queues it here
(``HandOffs.submit``) and chooses around it: no writer waits on a hand-off.
``HandOff`` asks the known peers which are durable and has the first that will
pull it from this node (a stage-only Promote naming this node alone), waiting
at most ``HANDOFF_TIMEOUT_S``. Once a durable peer holds it, the adapter is an
ordinary cold one (a copy answers elsewhere) that a later eviction may drop;
a hand-off that failed leaves it held as the last copy for
``REFUSED_FOR_S`` before it is tried again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from adapter_fabric.errors import FabricError
from adapter_fabric.node.victims import ASK_TIMEOUT_S
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
#: hand-offs running at once (each is a peer's pull from this node), and queued at most
CONCURRENT_HANDOFFS = 2
MAX_QUEUED_HANDOFFS = 64
#: seconds a last copy no durable peer took is held as such before a hand-off is tried again
REFUSED_FOR_S = 60.0


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
    """Has a durable peer (with placement: one of the adapter's homes) pull a last copy from this node; true only once one holds it."""

    def __init__(
        self, channels: PeerChannels, peers: Callable[[], list[str]], me: str, timeout: float = HANDOFF_TIMEOUT_S,
        homes: Callable[[Candidate], list[str]] | None = None,
    ) -> None:  # fmt: skip
        """``homes``: the live homes of a victim but this node, first home first (``node.homes``): they take last copies,
        not any durable peer."""
        self.channels = channels
        self.homes = homes
        self.peers = peers
        #: the address this node serves on (``PeerSource.me``)
        self.me = me
        self.timeout = timeout

    def __call__(self, victim: Candidate) -> bool:
        """Whether a durable peer (a home) now holds ``victim`` (pulled from this node under its first id)."""
        if self.homes is not None:
            durable = self.homes(victim)
        else:
            durable = [peer for peer in self.peers() if peer_calls.is_durable(self.channels, peer, timeout=ASK_TIMEOUT_S)]
        for peer in durable:
            if self._pull_onto(peer, victim):
                metrics.HANDOFFS.labels("ok").inc()
                return True
        metrics.HANDOFFS.labels("none" if not durable else "refused").inc()
        if not durable:
            log.info("no %s answers: the last copy of %s stays", "live home" if self.homes is not None else "durable peer", victim.digest)
        return False

    @property
    def _what(self) -> str:
        return "home" if self.homes is not None else "durable peer"

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
            log.warning("%s %s did not take the last copy of %s: %s", self._what, peer, adapter_id, error_from_rpc(exc, peer=peer))
            return False
        event(log, f"handed a last copy to a {self._what}", adapter=adapter_id, digest=victim.digest, peer=peer, bytes=victim.size)
        return True


@dataclass(frozen=True)
class Running:
    """A hand-off under way: the victim and when it started (``time.monotonic``)."""

    victim: Candidate
    since: float


class HandOffs:
    """Last copies handed to durable peers in the background, ``CONCURRENT_HANDOFFS`` at a time, each bounded by its ``HandOff``.

    ``on_done`` is called after each hand-off ends, whatever its outcome: the eviction then chooses again.
    """

    def __init__(self, hand_off: Callable[[Candidate], bool], on_done: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.hand_off = hand_off
        self.on_done = on_done
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENT_HANDOFFS, thread_name_prefix="handoff")
        self._lock = threading.Lock()  # guards _running and _refused; never held across a hand-off
        self._running: dict[str, Running] = {}  # by digest: queued or pulling
        self._refused: dict[str, float] = {}  # digest -> when its last hand-off failed

    def submit(self, victim: Candidate) -> bool:
        """Queue ``victim`` (a last copy) for a hand-off; False when it cannot be (one failed lately, or the queue is full)."""
        with self._lock:
            if victim.digest in self._running:
                return True
            if self.refused_lately(victim.digest) or len(self._running) >= MAX_QUEUED_HANDOFFS:
                return False
            self._running[victim.digest] = Running(victim, self.clock())
        self._pool.submit(self._run, victim)
        return True

    def running(self) -> list[Running]:
        """The hand-offs queued or under way, oldest first."""
        with self._lock:
            return sorted(self._running.values(), key=lambda r: r.since)

    def refused_lately(self, digest: str) -> bool:
        """Whether a hand-off of ``digest`` failed within ``REFUSED_FOR_S`` (it is held as the last copy meanwhile)."""
        failed = self._refused.get(digest)
        return failed is not None and self.clock() - failed < REFUSED_FOR_S

    def close(self) -> None:
        """Wait for nothing: running hand-offs end by their own bound; queued ones are dropped (the copies stay)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, victim: Candidate) -> None:
        try:
            ok = self.hand_off(victim)
        except Exception:  # noqa: BLE001 (a hand-off that breaks keeps the copy, and the eviction goes on)
            log.exception("handing the last copy of %s to a durable peer failed", victim.digest)
            ok = False
        with self._lock:
            self._running.pop(victim.digest, None)
            if ok:
                self._refused.pop(victim.digest, None)
            else:
                self._refused[victim.digest] = self.clock()
                # forget failures long past: the map stays bounded by what failed within the window
                self._refused = {d: t for d, t in self._refused.items() if self.clock() - t < REFUSED_FOR_S}
        self.on_done()
