"""``build_node``: the one place a node is wired, from its settings to a ``Node`` ready to ``start``.

Order (each step's failure is one line, status 1; ``adapter_fabric.node.startup``):
the probe endpoint first (``/healthz`` live, ``/readyz`` not yet), then
security files, the trusted signers, the policy, the store (crash recovery,
expiry of abandoned entries), the model, the gRPC port (port reuse off: a
second node on a busy port fails instead of sharing it) and the data
channel's port. Every part is handed what it calls at construction (the
store is told whom to wake when its export directory changes and where
damage goes); nothing is assigned into a part after it was made.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from adapter_fabric.errors import FabricError
from adapter_fabric.integrations.sglang import SGLangClient
from adapter_fabric.node.background import expire
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.data_server import DataServer
from adapter_fabric.node.engine_drive import SGLangDrive
from adapter_fabric.node.engine_retarget import retarget_for
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.node.eviction import Evictor, RefuseRoom
from adapter_fabric.node.gate import AccessGate
from adapter_fabric.node.handoff import HandOff
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.node import FABRIC_SERVICE, Node, Readiness
from adapter_fabric.node.observe import ObservedPuller, RpcObserver, refresh_gauges
from adapter_fabric.node.origin_fetch import build_origin_fetches
from adapter_fabric.node.peer_reads import PeerReads
from adapter_fabric.node.policy_reloads import PolicyReloads
from adapter_fabric.node.promotes import Promotes
from adapter_fabric.node.repair import DamageReports, Repairs
from adapter_fabric.node.scrub import Scrubber
from adapter_fabric.node.servicer import FabricServicer
from adapter_fabric.node.settings import NodeSettings, fail
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.node.slots import Slots
from adapter_fabric.node.stage_many import StageMany
from adapter_fabric.node.staging import Staging
from adapter_fabric.node.startup import (
    bind,
    build_model,
    listen_data_channel,
    load_peer_token,
    load_policy,
    load_security,
    load_trusted,
    membership,
    open_store,
    start_endpoint,
)
from adapter_fabric.node.store_status import StoreReport
from adapter_fabric.node.victims import Candidates, CopiesElsewhere
from adapter_fabric.observability import metrics
from adapter_fabric.rpc.draining import DrainGate
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.rpc.security import BearerAuth
from adapter_fabric.store.eviction import Candidate
from adapter_fabric.transport import wire
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.discovery import PeerSource
from adapter_fabric.transport.fetch_metadata import announce_data_port
from adapter_fabric.transport.members import MemberView

#: gRPC reuses ports by default, so a second node on a busy port would share it
NO_PORT_REUSE = ("grpc.so_reuseport", 0)
DURABLE = "this node is durable (--when-full refuse): it never evicts"


def build_node(settings: NodeSettings) -> Node:
    """Every part of a node, wired; nothing serves until ``Node.start``. Call it on the event loop the node will run on."""
    readiness = Readiness()
    endpoint = start_endpoint(settings, readiness)  # /healthz answers from here on; /readyz says "not ready" until start
    tls, token = load_security(settings)
    trusted = load_trusted(settings)  # before the store: its export directory lists only what they signed
    policy = load_policy(settings)
    peer_token = load_peer_token(settings, token, policy)  # the token sent to members: never the cluster token under a policy
    export_dir = str(settings.export_dir) if settings.export_dir else None
    #: what the engines beside the node registered (--engine-url): shown in listings, held against eviction; the driven
    #: SGLang (--sglang-url; it needs --export-dir) is read by its drive through the same view, shown, holding nothing
    driven = (settings.sglang_url,) if settings.sglang_url and export_dir else ()
    engines = EngineViews(settings.engine_url, export_dir, driven=driven) if settings.engine_url or driven else None
    #: the SGLang the node drives: loads what the export dir holds, unloads before evicting
    drive = (
        SGLangDrive(SGLangClient(settings.sglang_url), engines, export_dir, settings.sglang_sync_interval)
        if engines is not None and export_dir is not None and driven
        else None
    )
    damage = DamageReports()  # what verified reads and the scrub find damaged, for the repairs to pull again
    # A stage, pull, unstage or eviction changes the export directory: a driven SGLang reconciles now, not at its next tick.
    store = open_store(settings, trusted, policy, on_export_change=drive.poke if drive is not None else None, on_damage=damage.found)
    expire(store, settings.expire_abandoned_after)
    model = build_model(settings)

    # Observe first: it sees refusals by the auth interceptor too. Auth next: an unauthenticated
    # Fetch is refused before it counts against the peer's streams.
    drain_gate = DrainGate()  # once draining, new calls are refused by name (grpc's stop would refuse them unnamed)
    # With a policy, the gate resolves every call's principal and checks its verb (node.gate); else the one token, as before.
    auth = AccessGate(policy, store, token) if policy is not None else BearerAuth(token, peer_reads=settings.auth_peer_reads) if token else None
    streams = PeerStreamLimit(settings.max_streams_per_peer)  # gRPC Fetch and the data channel count together
    interceptors = [RpcObserver(), drain_gate, *([auth] if auth is not None else []), streams]
    server = grpc.aio.server(options=[*wire.SERVER_OPTIONS, NO_PORT_REUSE], interceptors=interceptors)
    port = bind(server, settings, tls.server_credentials() if tls.enabled else None)
    data_socket = listen_data_channel(settings)
    data_port = data_socket.getsockname()[1] if data_socket is not None else 0
    host = settings.listen.rsplit(":", 1)[0]

    # Pulls present this node's own certificate and peer token to its members only (transport.membership); the bound port
    # tells peers that are this node.
    peer_source = PeerSource(static=settings.peers, dns=settings.peers_dns, me=f"{host}:{port}")
    #: with placement (--homes), the fleet: --peers, --peers-dns and --peers-k8s; then it is also whom credentials go to
    view = MemberView(peer_source.me, settings.peers) if settings.homes > 0 else None
    members = membership(settings, tls, peer_token, view)
    options = [*wire.CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", settings.peer_tls_name)] if settings.peer_tls_name else [])]
    data_channels = DataChannels(
        tls.client_ssl_context() if tls.enabled else None, token=peer_token, tls_name=settings.peer_tls_name, members=members,
        anonymous_tls=tls.client_ssl_context(anonymous=True) if tls.enabled else None,
    )
    channels = PeerChannels(
        options, credentials=tls.channel_credentials() if tls.enabled else None, token=peer_token, data=data_channels, members=members,
        anonymous_credentials=tls.channel_credentials(anonymous=True) if tls.enabled else None,
    )

    #: each adapter's homes among the members (node.homes): lookups, publishing, re-homing, eviction's last copies
    homes = (
        Homes(view, settings.homes, channels, store, lambda: streams.streams_open, dns=settings.peers_dns, k8s=settings.peers_k8s)
        if view is not None
        else None
    )
    context = NodeContext(store, model, peer_source)

    def origin_backed(victim: Candidate) -> bool:
        """Whether an origin gave this digest (it holds a copy: never the last one). ``origins`` is read at call time: it is
        built below, with the evictor's room."""
        if homes is not None and homes.backed(victim.digest):
            return True
        return any(origins.record_of(i, victim.digest) is not None for i in victim.ids)

    # At --max-store-bytes the store refuses a writer; the evictor makes room outside its locks (--when-full evict: cold
    # adapters go, a last copy is handed to a durable peer first), or a durable node refuses by name (node.eviction).
    evictor = (
        Evictor(
            store,
            Candidates(
                store, context.in_use, model.resident_digests if model is not None else set, engines,
                home_ids=homes.home_ids if homes is not None else None,
            ),
            low_water=settings.evict_to,
            copies=CopiesElsewhere(channels, peer_source.peers, homes=homes, backed=origin_backed),
            hand_off=HandOff(channels, peer_source.peers, peer_source.me, homes=homes.live_homes if homes is not None else None),
            hands_to="a home" if homes is not None else "a durable peer",
            engines=engines,
            drive=drive,
        )
        if not settings.durable
        else None
    )
    room = evictor or RefuseRoom(DURABLE)
    puller = ObservedPuller(
        store, channels, stall_timeout=settings.stall_timeout, download_rate=settings.download_rate, known_peers=peer_source.peers,
        listen_port=port, make_room=room.make_room,
    )
    signed = SignedAdapters(store, puller, trusted)
    try:
        #: a request without a peer: held, else the fleet (its homes) or the peers, else the --origin list (node.origin_fetch)
        origins = build_origin_fetches(settings, context, signed, make_room=room.make_room, homes=homes)
    except FabricError as exc:
        fail(f"--origin: {exc}")
    #: the vLLM engines beside the node drop an adapter whose id moved to its origin's new revision (node.engine_retarget)
    retarget = retarget_for(settings, store, origins, export_dir)
    peer_reads = PeerReads(
        context, puller, signed, upload_rate=settings.upload_rate, durable=settings.durable, announce=announce_data_port(data_port), origins=origins,
        homes=homes, streams_open=lambda: streams.streams_open, upload_slots=settings.upload_slots,
    )
    staging = Staging(context, signed, make_room=room.make_room, on_staged=homes.published if homes is not None else None)
    servicer = FabricServicer(
        staging=staging,
        stage_many=StageMany(staging),
        peer_reads=peer_reads,
        promotes=Promotes(context, signed, origins, homes, model_names=(settings.model, *settings.base_model) if model is not None else ()),
        slots=Slots(context, max_new_tokens=settings.max_new_tokens, engines=engines, origins=origins),
        store_status=StoreReport(context, expire_after=settings.expire_abandoned_after, evictor=evictor, origins=origins),
        policy=policy is not None,
    )
    wire.add_fabric_servicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((FABRIC_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    metrics.set_refresh(refresh_gauges(store, model, adapter_labels=settings.metrics_adapter_labels))
    data_server = (
        DataServer(peer_reads, streams, auth=auth, tls=tls.server_ssl_context() if tls.enabled else None, write_stall=settings.stall_timeout)
        if data_socket is not None
        else None
    )
    return Node(
        settings=settings, store=store, model=model, context=context, server=server, health=health, port=port, readiness=readiness,
        endpoint=endpoint, drain_gate=drain_gate, streams=streams, channels=channels, peer_reads=peer_reads,
        reloads=PolicyReloads(policy, context.io, applied=lambda new: store.set_tenant_quotas(new.quotas)),
        evictor=evictor, repairs=Repairs(damage, store, peer_source, signed), scrubber=Scrubber(store, damage, rate=settings.scrub_rate),
        engines=engines, drive=drive, origins=origins, homes=homes, retarget=retarget, data_server=data_server, data_socket=data_socket,
        banner=_banner(settings, host, port, model, tls.enabled, token, policy, endpoint, data_port),
    )


def _banner(settings: NodeSettings, host: str, port: int, model, tls: bool, token: str | None, policy, endpoint, data_port: int) -> str:
    """The line a node prints once it listens: tests and the demo read the ports from it when --listen or --metrics-listen end in :0."""
    device = model.device if model is not None else "store-only"
    guard = ("mTLS" if settings.tls_ca else "TLS") if tls else "plaintext"
    guard += ", token" + (" (peer reads too)" if settings.auth_peer_reads else "") if token else ""
    guard += f", policy of {len(policy.policy.principals)} principals" if policy is not None else ""
    probes = f", metrics on {settings.metrics_listen.rsplit(':', 1)[0]}:{endpoint.port}" if endpoint else ""
    guard += f", data channel on port {data_port}" if data_port else ", no data channel"
    return f"fabric-node listening on {host}:{port} (model={settings.model}, device={device}, store={settings.store}, {guard}{probes})"
