"""The node process: a grpc.aio server for fabric.v1 plus health checking and reflection.

Start-up order (each step's failure is one line, status 1; ``adapter_fabric.node.startup``):
the probe endpoint first (``/healthz`` live, ``/readyz`` not yet), then
security files, the store (crash recovery, expiry of abandoned entries), the
model, and the gRPC port (port reuse off: a second node on a busy port fails
instead of sharing it). Only then is the node ready.

SIGTERM (or SIGINT) drains: ``/readyz`` and gRPC health turn NOT_SERVING
first, so load balancers and peers stop sending; a new call is refused with
UNAVAILABLE naming the shutdown (``adapter_fabric.rpc.draining``) while the node
listens on until peers' Fetch streams end; in-flight calls, Fetch streams
included, get --drain-timeout seconds in all to finish and are cut after.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from adapter_fabric import __version__
from adapter_fabric.errors import FabricError
from adapter_fabric.observability import metrics
from adapter_fabric.observability.endpoint import ProbeEndpoint
from adapter_fabric.observability.logs import event
from adapter_fabric.rpc.draining import DrainGate
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.rpc.security import BearerAuth
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.hygiene import expire_abandoned
from adapter_fabric.transport import wire
from adapter_fabric.transport.discovery import PeerSource
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.fetch_metadata import announce_data_port
from adapter_fabric.trust.signing import TrustedSigners
from adapter_fabric.v1 import fabric_pb2
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.data_server import DataServer
from adapter_fabric.integrations.sglang import SGLangClient
from adapter_fabric.node.engine_drive import SGLangDrive
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.eviction import Evictor, RefuseRoom
from adapter_fabric.node.handoff import HandOff
from adapter_fabric.node.victims import Candidates, CopiesElsewhere

from adapter_fabric.node.gate import AccessGate
from adapter_fabric.node.engine_retarget import retarget_for
from adapter_fabric.node.origin_fetch import build_origin_fetches
from adapter_fabric.node.policy_reloads import PolicyReloads
from adapter_fabric.node.observe import ObservedPuller, RpcObserver, refresh_gauges
from adapter_fabric.node.peer_reads import DRAIN_CUT_MARGIN_S, PeerReads
from adapter_fabric.node.promotes import Promotes
from adapter_fabric.node.repair import Repairs
from adapter_fabric.node.scrub import Scrubber
from adapter_fabric.node.servicer import FabricServicer
from adapter_fabric.node.settings import NodeSettings, fail
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.node.slots import Slots
from adapter_fabric.node.staging import Staging
from adapter_fabric.node.startup import bind, check_bindable, load_policy, load_security, name_store_holder, open_store
from adapter_fabric.node.store_status import StoreReport

if TYPE_CHECKING:  # loaded in build_model, when the node has a model
    from adapter_fabric.serving.multi_lora import MultiLoraModel

__all__ = ["build_model", "load_security", "serve"]

log = logging.getLogger("fabric.node")

SERVICE_NAME = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"].full_name
#: gRPC reuses ports by default, so a second node on a busy port would share it
NO_PORT_REUSE = ("grpc.so_reuseport", 0)
#: how often abandoned uploads and partials are looked for, at most (and at least)
HYGIENE_INTERVAL_MAX_S = 600.0
HYGIENE_INTERVAL_MIN_S = 0.5
#: how often the --policy file is checked for a change (SIGHUP reloads it at once)
POLICY_POLL_S = 2.0
#: a draining node stops listening once no Fetch stream has been open this long (a receiver's next request hears why first)
DRAIN_LINGER_S = 0.5
DRAIN_POLL_S = 0.05


def build_model(settings: NodeSettings) -> MultiLoraModel | None:
    """The multi-adapter model, or None for a store-only node."""
    if settings.store_only:
        return None
    from adapter_fabric.serving.multi_lora import MultiLoraModel
    from adapter_fabric.serving.tiny import load_base_model

    try:
        base = load_base_model(settings.model)
    except FabricError:
        raise  # already one line naming the problem (node.main prints it)
    except Exception as exc:  # noqa: BLE001 (transformers raises many kinds for a bad model directory)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        fail(f"--model {settings.model}: cannot load it: {type(exc).__name__}: {first_line}")
    return MultiLoraModel(
        base,
        slots=settings.slots,
        max_rank=settings.max_rank,
        target_modules=settings.target_modules,
        device=settings.device,
    )


class Readiness:
    """Whether the node takes traffic: false until start-up finishes, and again while it drains."""

    def __init__(self) -> None:
        self.ready = False
        metrics.READY.set(0)

    def set(self, ready: bool) -> None:
        self.ready = ready
        metrics.READY.set(1 if ready else 0)


def start_endpoint(settings: NodeSettings, readiness: Readiness) -> ProbeEndpoint | None:
    if not settings.metrics_listen:
        return None
    check_bindable("--metrics-listen", settings.metrics_listen)
    host, _, port = settings.metrics_listen.rpartition(":")
    try:
        return ProbeEndpoint(host, int(port), lambda: readiness.ready, read_timeout=settings.metrics_read_timeout).start()
    except OSError as exc:
        fail(f"--metrics-listen {settings.metrics_listen}: cannot listen there: {exc.strerror or exc}")


async def _expire_periodically(store: AdapterStore, max_age: float) -> None:
    interval = min(HYGIENE_INTERVAL_MAX_S, max(HYGIENE_INTERVAL_MIN_S, max_age / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(_expire, store, max_age)
        except OSError as exc:  # a full or failing disk: say so, and try again next round
            log.warning("expiring abandoned uploads and partials failed: %s", exc)


async def _collect_garbage(node: "Node") -> None:
    """What no ref reaches after a restart goes, on an I/O thread once the node serves (it holds the store's lock)."""
    started = time.monotonic()
    try:
        await node.context.io(node.context.store.collect_garbage)
    except (OSError, FabricError) as exc:  # a damaged or vanishing store: later collections read it whole again
        log.warning("collecting what no ref reaches after the restart failed: %s", exc)
        return
    log.info("collected what no ref reaches after the restart in %.1fs", time.monotonic() - started)


def _expire(store: AdapterStore, max_age: float) -> None:
    for item in expire_abandoned(store, max_age):
        metrics.EXPIRED.labels(item.kind).inc()
        metrics.EXPIRED_BYTES.inc(item.bytes)
        event(log, f"expired abandoned {item.kind}", kind=item.kind, adapter=item.adapter_id or None, digest=item.digest or None,
              bytes=item.bytes, age_s=round(item.age_seconds, 1))


def load_trusted(settings: NodeSettings) -> TrustedSigners:
    """The --trusted-signers keys, read now so a bad file stops the node at start."""
    try:
        return TrustedSigners.from_files(settings.trusted_signers)
    except FabricError as exc:
        fail(str(exc))


class Node:
    """The node's parts, composed: the RPC groups behind the servicer, what they share, eviction, and the background scrub."""

    def __init__(
        self, settings: NodeSettings, store: AdapterStore, model: MultiLoraModel | None, channels: PeerChannels, peer_source: PeerSource,
        trusted: TrustedSigners, port: int,
    ) -> None:
        self.context = NodeContext(store, model, peer_source)
        #: what the engines beside the node registered (--engine-url): shown in listings, held against eviction; the driven
        #: SGLang (--sglang-url; it needs --export-dir) is read by its drive through the same view, shown, holding nothing
        export_dir = str(settings.export_dir) if settings.export_dir else None
        driven = (settings.sglang_url,) if settings.sglang_url and export_dir else ()
        self.engines = EngineViews(settings.engine_url, export_dir, driven=driven) if settings.engine_url or driven else None
        #: the SGLang the node drives: loads what the export dir holds, unloads before evicting
        self.drive = SGLangDrive(SGLangClient(settings.sglang_url), self.engines, export_dir, settings.sglang_sync_interval) if driven else None
        if self.drive is not None and store.exports is not None:
            store.exports.on_change = self.drive.poke  # a stage, pull, unstage or eviction: reconcile now, not at the next tick
        #: at --max-store-bytes the store refuses a writer; this makes room outside its locks (--when-full evict: cold adapters
        #: go, a last copy is handed to a durable peer first), or refuses by name on a durable node (node.eviction, node.handoff)
        self.evictor = (
            Evictor(
                store,
                Candidates(store, self.context.in_use, model.resident_digests if model is not None else set, self.engines),
                CopiesElsewhere(channels, peer_source.peers),
                hand_off=HandOff(channels, peer_source.peers, peer_source.me),
                low_water=settings.evict_to,
                engines=self.engines,
                drive=self.drive,
            )
            if not settings.durable
            else None
        )
        room = self.evictor or RefuseRoom("this node is durable (--when-full refuse): it never evicts")
        self.puller = ObservedPuller(
            store, channels, stall_timeout=settings.stall_timeout, download_rate=settings.download_rate, known_peers=peer_source.peers,
            listen_port=port, make_room=room.make_room,
        )
        signed = SignedAdapters(store, self.puller, trusted)
        try:
            #: a request without a peer: held, else the peers, else the --origin list (node.origin_fetch)
            self.context.origins = build_origin_fetches(settings, self.context, signed, make_room=room.make_room)
        except FabricError as exc:
            fail(f"--origin: {exc}")
        #: the vLLM engines beside the node drop an adapter whose id moved to its origin's new revision (node.engine_retarget)
        self.retarget = retarget_for(settings, store, self.context.origins, export_dir)
        promotes = Promotes(self.context, signed, model_names=(settings.model, *settings.base_model) if model is not None else ())
        self.peer_reads = PeerReads(self.context, self.puller, signed, upload_rate=settings.upload_rate, durable=settings.durable)
        self.servicer = FabricServicer(
            staging=Staging(self.context, signed, make_room=room.make_room),
            peer_reads=self.peer_reads,
            promotes=promotes,
            slots=Slots(self.context, max_new_tokens=settings.max_new_tokens, engines=self.engines),
            store_status=StoreReport(self.context, expire_after=settings.expire_abandoned_after, evictor=self.evictor),
            policy=settings.policy is not None,
        )
        #: damaged adapters pulled again from the peers, whether a read or the scrub found the damage
        self.repairs = Repairs(store, peer_source, signed)
        store.integrity.on_damage = self.repairs.damage_found
        self.scrubber = Scrubber(store, self.repairs, rate=settings.scrub_rate)
        if self.evictor is not None:
            self.evictor.start()

    def close(self) -> None:
        """After the server stopped: the scrub told to stop, the model worker's jobs finished, the peer channels closed."""
        self.scrubber.stop()
        if self.evictor is not None:
            self.evictor.close()
        self.repairs.close()
        self.context.close()
        self.puller.channels.close()


async def _streams_ended(streams: PeerStreamLimit, within: float) -> None:
    """Return once no Fetch stream has been open for DRAIN_LINGER_S (a receiver between two requests hears the refusal), or
    after ``within`` seconds less the margin ``PeerReads`` keeps to cut the last ones by name.

    The quiet is counted from the last stream's end, not from the signal: a node no peer was reading from stops at once.
    """
    loop = asyncio.get_running_loop()  # its clock is time.monotonic, as PeerStreamLimit.last_ended's
    give_up = loop.time() + max(0.0, within - min(DRAIN_CUT_MARGIN_S, within / 2))
    while True:
        quiet_since = streams.last_ended if streams.last_ended is not None else float("-inf")
        if streams.streams_open:
            quiet_since = loop.time()
        if loop.time() - quiet_since >= DRAIN_LINGER_S or loop.time() >= give_up:
            return
        await asyncio.sleep(DRAIN_POLL_S)


async def start_data_channel(
    settings: NodeSettings, node: Node, streams: PeerStreamLimit, auth: BearerAuth | AccessGate | None, tls_context
) -> tuple[DataServer | None, int]:
    """The data channel on --listen's host (unless --data-port off), announced to peers in gRPC replies."""
    if settings.data_port < 0:
        return None, 0
    data_server = DataServer(node.peer_reads, streams, auth=auth, tls=tls_context, write_stall=settings.stall_timeout)
    host = settings.listen.rsplit(":", 1)[0].strip("[]")
    try:
        port = await data_server.start(host, settings.data_port)
    except OSError as exc:
        fail(f"--data-port {settings.data_port}: cannot listen on {host}:{settings.data_port}: {exc.strerror or exc}")
    node.peer_reads.announce = announce_data_port(port)
    return data_server, port


#: threads for the store's blocking I/O (``NodeContext.io``): they mostly wait on fsync, so more than asyncio's
#: default (cores + 4) lets concurrent Stage calls reach the committer together and share its syncs (group commit)
IO_THREADS = 32


async def serve(settings: NodeSettings) -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io"))
    metrics.BUILD.info({"version": __version__})
    readiness = Readiness()
    endpoint = start_endpoint(settings, readiness)  # /healthz answers from here on; /readyz says "not ready" until the end
    tls, token = load_security(settings)
    trusted = load_trusted(settings)  # before the store: its export directory lists only what they signed
    policy = load_policy(settings)
    store = open_store(settings, trusted, policy)
    if policy is not None:
        policy.on_reload = lambda new: store.set_tenant_quotas(new.quotas)
    _expire(store, settings.expire_abandoned_after)
    model = build_model(settings)

    # Observe first: it sees refusals by the auth interceptor too. Auth next: an unauthenticated
    # Fetch is refused before it counts against the peer's streams.
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcObserver()]
    drain_gate = DrainGate()  # once draining, new calls are refused by name (grpc's stop would refuse them unnamed)
    interceptors.append(drain_gate)
    # With a policy, the gate resolves every call's principal and checks its verb (node.gate); else the one token, as before.
    auth = AccessGate(policy, store, token) if policy is not None else BearerAuth(token, peer_reads=settings.auth_peer_reads) if token else None
    if auth is not None:
        interceptors.append(auth)
    streams = PeerStreamLimit(settings.max_streams_per_peer)  # gRPC Fetch and the data channel count together
    interceptors.append(streams)
    server = grpc.aio.server(options=[*wire.SERVER_OPTIONS, NO_PORT_REUSE], interceptors=interceptors)
    port = bind(server, settings, tls.server_credentials() if tls.enabled else None)
    host = settings.listen.rsplit(":", 1)[0]

    # Pulls present this node's own certificate and token to its peers; the bound port tells peers that are this node.
    peer_source = PeerSource(static=settings.peers, dns=settings.peers_dns, me=f"{host}:{port}")
    options = [*wire.CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", settings.peer_tls_name)] if settings.peer_tls_name else [])]
    data_channels = DataChannels(tls.client_ssl_context() if tls.enabled else None, token=token, tls_name=settings.peer_tls_name)
    channels = PeerChannels(options, credentials=tls.channel_credentials() if tls.enabled else None, token=token, data=data_channels)
    node = Node(settings, store, model, channels, peer_source, trusted, port)
    wire.add_fabric_servicer_to_server(node.servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    metrics.set_refresh(refresh_gauges(store, model))
    data_server, data_port = await start_data_channel(settings, node, streams, auth, tls.server_ssl_context() if tls.enabled else None)

    await server.start()
    readiness.set(True)  # before health: a caller that saw SERVING (fabric wait) finds /readyz true too
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    device = model.device if model is not None else "store-only"
    guard = ("mTLS" if settings.tls_ca else "TLS") if tls.enabled else "plaintext"
    guard += ", token" + (" (peer reads too)" if settings.auth_peer_reads else "") if token else ""
    guard += f", policy of {len(policy.policy.principals)} principals" if policy is not None else ""
    probes = f", metrics on {settings.metrics_listen.rsplit(':', 1)[0]}:{endpoint.port}" if endpoint else ""
    guard += f", data channel on port {data_port}" if data_server is not None else ", no data channel"
    # Tests and the demo read this line to learn the ports when --listen or --metrics-listen ends in :0.
    name_store_holder(settings, f"{host}:{port}")
    print(f"fabric-node listening on {host}:{port} (model={settings.model}, device={device}, store={settings.store}, {guard}{probes})", flush=True)

    collecting = asyncio.create_task(_collect_garbage(node))  # a restart's orphans: O(adapters), so after SERVING
    hygiene = asyncio.create_task(_expire_periodically(store, settings.expire_abandoned_after)) if settings.expire_abandoned_after > 0 else None
    watch_engines = asyncio.create_task(node.engines.watch(node.context.io)) if node.engines is not None else None
    drive_sglang = asyncio.create_task(node.drive.watch(node.context.io)) if node.drive is not None else None
    retarget = asyncio.create_task(node.retarget.watch(node.context.io, node.context.origins.resolve)) if node.retarget is not None else None
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # SIGHUP reloads --policy (coalesced, off the loop: node.policy_reloads); without one it is logged and ignored
    reloads = PolicyReloads(auth.policy if isinstance(auth, AccessGate) else None, node.context.io)
    loop.add_signal_handler(signal.SIGHUP, reloads.on_sighup)
    poll_policy = asyncio.create_task(reloads.run(POLICY_POLL_S)) if reloads.policy is not None else None
    await stopping.wait()

    # Drain: out of rotation first, then in-flight calls get the bound to finish; what is left is cut.
    readiness.set(False)
    log.info("draining: readiness false, health NOT_SERVING, %.1fs for in-flight calls", settings.drain_timeout)
    started = loop.time()
    refusal = f"this node is shutting down (SIGTERM): it takes no new calls while those in flight finish (--drain-timeout {settings.drain_timeout:g}s); use another node"
    drain_gate.close(refusal)
    streams.close(refusal)
    node.peer_reads.start_draining(settings.drain_timeout)  # Fetch streams still sending near the bound end by name
    await health.enter_graceful_shutdown()
    for task in (collecting, hygiene, poll_policy, watch_engines, drive_sglang, retarget):
        if task is not None:
            task.cancel()
    # Listening on while peers' Fetch streams run: a receiver's next request hears the refusal above, not "connection refused".
    await _streams_ended(streams, within=settings.drain_timeout)
    left = max(0.0, settings.drain_timeout - (loop.time() - started))
    await asyncio.gather(server.stop(left), *([data_server.close(left)] if data_server else []))
    node.close()
    if endpoint is not None:
        endpoint.close()
    log.info("stopped")
