"""The node process: a grpc.aio server for fabric.v1 plus health checking and reflection.

SIGTERM (or SIGINT) shuts down gracefully: health turns NOT_SERVING first, so
load balancers stop sending, then in-flight calls get a grace period to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from fabric.transport import wire
from fabric.transport.discovery import PeerSource
from fabric.errors import FabricError
from fabric.rpc.limits import PeerStreamLimit
from fabric.rpc.security import BearerAuth, TlsFiles, read_token
from fabric.store import AdapterStore
from fabric.trust.signing import TrustedSigners
from fabric.transport.pull import PeerChannels, PeerPuller
from fabric.v1 import fabric_pb2
from node.servicer import FabricServicer
from node.settings import NodeSettings

log = logging.getLogger("fabric.node")

SERVICE_NAME = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"].full_name
SHUTDOWN_GRACE_S = 10.0


def build_model(settings: NodeSettings):
    """The multi-adapter model, or None for a store-only node."""
    if settings.store_only:
        return None
    from fabric.serving.multi_lora import MultiLoraModel
    from fabric.serving.tiny import load_base_model

    base = load_base_model(settings.model)
    return MultiLoraModel(
        base,
        slots=settings.slots,
        max_rank=settings.max_rank,
        target_modules=settings.target_modules,
        device=settings.device,
    )


def load_security(settings: NodeSettings) -> tuple[TlsFiles, str | None]:
    """The TLS files and token the flags name, read now so a bad file stops the node at start, not at the first call."""
    try:
        tls = TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_ca)
        if tls.enabled:
            tls.server_credentials()
        token = read_token(settings.auth_token_file) if settings.auth_token_file else None
    except FabricError as exc:
        raise SystemExit(f"fabric-node: {exc}") from None
    return tls, token


def load_trusted(settings: NodeSettings) -> TrustedSigners:
    """The --trusted-signers keys, read now so a bad file stops the node at start."""
    try:
        return TrustedSigners.from_files(settings.trusted_signers)
    except FabricError as exc:
        raise SystemExit(f"fabric-node: {exc}") from None


async def serve(settings: NodeSettings) -> None:
    tls, token = load_security(settings)
    store = AdapterStore(
        settings.store,
        chunk_size=settings.chunk_size,
        max_bytes=settings.max_store_bytes or None,
        max_adapter_bytes=settings.max_adapter_bytes,
        max_header_bytes=settings.max_header_bytes,
        export_dir=settings.export_dir,
    )
    model = build_model(settings)
    # Pulls present this node's own certificate and token to its peers.
    channels = PeerChannels(credentials=tls.channel_credentials() if tls.enabled else None, token=token)
    puller = PeerPuller(store, channels, stall_timeout=settings.stall_timeout, download_rate=settings.download_rate)
    peer_source = PeerSource(static=settings.peers, dns=settings.peers_dns, me=settings.listen)
    servicer = FabricServicer(store=store, model=model, puller=puller, peers=settings.peers, upload_rate=settings.upload_rate, peer_source=peer_source,
                               max_new_tokens=settings.max_new_tokens, scrub_rate=settings.scrub_rate,
                               trusted=load_trusted(settings))

    # Auth first: an unauthenticated Fetch is refused before it counts against the peer's streams.
    interceptors: list[grpc.aio.ServerInterceptor] = [BearerAuth(token, peer_reads=settings.auth_peer_reads)] if token else []
    interceptors.append(PeerStreamLimit(settings.max_streams_per_peer))
    server = grpc.aio.server(options=wire.SERVER_OPTIONS, interceptors=interceptors)
    wire.add_fabric_servicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)

    port = server.add_secure_port(settings.listen, tls.server_credentials()) if tls.enabled else server.add_insecure_port(settings.listen)
    if port == 0:
        raise SystemExit(f"fabric-node: cannot listen on {settings.listen}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    host = settings.listen.rsplit(":", 1)[0]
    device = model.device if model is not None else "store-only"
    # Tests and the demo read this line to learn the port when --listen ends in :0.
    guard = ("mTLS" if settings.tls_ca else "TLS") if tls.enabled else "plaintext"
    guard += ", token" + (" (peer reads too)" if settings.auth_peer_reads else "") if token else ""
    print(f"fabric-node listening on {host}:{port} (model={settings.model}, device={device}, store={settings.store}, {guard})", flush=True)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()

    log.info("shutting down: health NOT_SERVING, %.0fs grace for in-flight calls", SHUTDOWN_GRACE_S)
    await health.enter_graceful_shutdown()
    await server.stop(SHUTDOWN_GRACE_S)
    servicer.close()
