"""A node: every part ``build_node`` wired, and its life. ``start`` serves, ``drain`` stops taking work and lets what runs
finish (SIGTERM), ``close`` lets go of what is left. The node owns its background tasks and threads.

Draining: ``/readyz`` and gRPC health turn NOT_SERVING first, so load balancers
and peers stop sending; a new call is refused with UNAVAILABLE naming the
shutdown (``adapter_fabric.rpc.draining``) while the node listens on until
peers' Fetch streams end; in-flight calls, Fetch streams included, get
--drain-timeout seconds in all to finish and are cut after.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from adapter_fabric.node import background
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.data_server import DataServer
from adapter_fabric.node.engine_drive import SGLangDrive
from adapter_fabric.node.engine_retarget import EngineRetarget
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.eviction import Evictor
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.origin_fetch import OriginFetches
from adapter_fabric.node.peer_reads import PeerReads
from adapter_fabric.node.policy_reloads import PolicyReloads
from adapter_fabric.node.repair import Repairs
from adapter_fabric.node.scrub import Scrubber
from adapter_fabric.node.settings import NodeSettings
from adapter_fabric.node.startup import name_store_holder
from adapter_fabric.observability import metrics
from adapter_fabric.observability.endpoint import ProbeEndpoint
from adapter_fabric.rpc.draining import DrainGate
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.channels import PeerChannels

if TYPE_CHECKING:
    from adapter_fabric.serving.multi_lora import MultiLoraModel

log = logging.getLogger("fabric.node")

#: the gRPC services health answers for ("" is the server as a whole)
FABRIC_SERVICE = "fabric.v1.Fabric"


class Readiness:
    """Whether the node takes traffic: false until start-up finishes, and again while it drains."""

    def __init__(self) -> None:
        self.ready = False
        metrics.READY.set(0)

    def set(self, ready: bool) -> None:
        self.ready = ready
        metrics.READY.set(1 if ready else 0)

    def __call__(self) -> bool:
        return self.ready


@dataclass
class Node:
    """Every part of a running node (see ``adapter_fabric.node.assembly.build_node`` for how they are wired)."""

    settings: NodeSettings
    store: AdapterStore
    model: MultiLoraModel | None
    context: NodeContext
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    readiness: Readiness
    endpoint: ProbeEndpoint | None
    drain_gate: DrainGate
    streams: PeerStreamLimit
    channels: PeerChannels
    peer_reads: PeerReads
    #: the --policy file's reloads (SIGHUP, or a change on disk): coalesced, off the event loop
    reloads: PolicyReloads
    evictor: Evictor | None
    repairs: Repairs
    scrubber: Scrubber
    engines: EngineViews | None
    drive: SGLangDrive | None
    #: a request naming no peer: held, else the peers, else the --origin list
    origins: OriginFetches
    #: engines kept off a moved id's old digest (--origin with --engine-url), None without
    retarget: EngineRetarget | None
    #: the node's part in a fleet (--homes): members, homes, lookups, publishing, re-homing; None without placement
    homes: Homes | None
    data_server: DataServer | None
    data_socket: socket.socket | None
    #: what the node says once it listens (tests and the demo read the ports from it)
    banner: str
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def data_port(self) -> int:
        return self.data_socket.getsockname()[1] if self.data_socket is not None else 0

    async def start(self) -> None:
        """Serve: gRPC, the data channel, health SERVING, then the background jobs (the restart's collection among them)."""
        if self.data_server is not None and self.data_socket is not None:
            await self.data_server.start(self.data_socket)
        if self.homes is not None:
            await self.context.io(self.homes.start)  # --peers-k8s: its first list of members, bounded, before a Stage is taken
        await self.server.start()
        if self.evictor is not None:
            self.evictor.start()
        self.readiness.set(True)  # before health: a caller that saw SERVING (fabric wait) finds /readyz true too
        for service in ("", FABRIC_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        name_store_holder(self.settings, f"{self.settings.listen.rsplit(':', 1)[0]}:{self.port}")  # for a second node's refusal
        print(self.banner, flush=True)
        io, settings = self.context.io, self.settings
        jobs = [background.collect_garbage(self.store, io)]  # a restart's orphans: O(adapters), so after SERVING
        if settings.expire_abandoned_after > 0:
            jobs.append(background.expire_periodically(self.store, settings.expire_abandoned_after, io))
        if self.engines is not None:
            jobs.append(self.engines.watch(io))
        if self.drive is not None:
            jobs.append(self.drive.watch(io))
        if self.retarget is not None:
            jobs.append(self.retarget.watch(io, self.origins.resolve))
        if self.reloads.policy is not None:
            jobs.append(self.reloads.run(background.POLICY_POLL_S))
        if self.homes is not None:
            jobs.append(self.homes.watch(io))
        self._tasks = [background.start(job) for job in jobs]

    async def drain(self) -> None:
        """Out of rotation first, then in-flight calls get --drain-timeout to finish; what is left is cut."""
        self.readiness.set(False)
        bound = self.settings.drain_timeout
        log.info("draining: readiness false, health NOT_SERVING, %.1fs for in-flight calls", bound)
        loop = asyncio.get_running_loop()
        started = loop.time()
        refusal = f"this node is shutting down (SIGTERM): it takes no new calls while those in flight finish (--drain-timeout {bound:g}s); use another node"
        self.drain_gate.close(refusal)
        self.streams.close(refusal)
        self.peer_reads.start_draining(bound)  # Fetch streams still sending near the bound end by name
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        # Listening on while peers' Fetch streams run: a receiver's next request hears the refusal above, not "connection refused".
        await background.streams_ended(self.streams, within=bound)
        left = max(0.0, bound - (loop.time() - started))
        await asyncio.gather(self.server.stop(left), *([self.data_server.close(left)] if self.data_server is not None else []))

    def close(self) -> None:
        """After the server stopped: the scrub and the evictor told to stop, the model worker's jobs finished, channels closed."""
        if self.homes is not None:
            self.homes.close()
        self.scrubber.stop()
        if self.evictor is not None:
            self.evictor.close()
        self.repairs.close()
        self.context.close()
        self.channels.close()
        if self.endpoint is not None:
            self.endpoint.close()
        log.info("stopped")
