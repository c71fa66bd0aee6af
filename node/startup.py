"""Start-up checks: each bad flag or file stops the node with one line naming it and what it needs.

Everything here runs before the node says "listening"; a failure raises
``SystemExit`` through ``adapter_fabric.node.settings.fail`` (one line on stderr, status 1),
never a traceback, and leaves no state behind.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from adapter_fabric.access.policy_file import PolicyFile
from adapter_fabric.errors import FabricError
from adapter_fabric.node.data_accept import listen_socket
from adapter_fabric.node.settings import NodeSettings, fail
from adapter_fabric.observability.endpoint import ProbeEndpoint
from adapter_fabric.rpc.security import TlsFiles, read_token
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.discovery import resolve
from adapter_fabric.transport.members import MemberView
from adapter_fabric.transport.membership import Membership
from adapter_fabric.trust.signing import TrustedSigners

if TYPE_CHECKING:  # the model module loads torch: named for the type checker only
    from adapter_fabric.serving.multi_lora import MultiLoraModel

#: what each TLS flag's file must hold, and what it holds when the flags were swapped
_PEM_KINDS = {"--tls-cert": (b"-----BEGIN CERTIFICATE-----", "certificate"), "--tls-key": (b"PRIVATE KEY-----", "private key")}


def _check_pem_kind(flag: str, path: Path | None) -> None:
    if path is None:
        return
    try:
        data = Path(path).read_bytes()
    except OSError:
        return  # TlsFiles says it, naming the file (adapter_fabric.rpc.security)
    marker, what = _PEM_KINDS[flag]
    if marker not in data:
        other = "--tls-key" if flag == "--tls-cert" else "--tls-cert"
        swapped = _PEM_KINDS[other][0] in data
        hint = f" (it holds a {_PEM_KINDS[other][1]}: are --tls-cert and --tls-key swapped?)" if swapped else ""
        fail(f"{flag} {path}: holds no PEM {what}{hint}")


def load_security(settings: NodeSettings) -> tuple[TlsFiles, str | None]:
    """The TLS files and token the flags name, read now so a bad file stops the node at start, not at the first call."""
    try:
        tls = TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_ca)
        _check_pem_kind("--tls-cert", settings.tls_cert)
        _check_pem_kind("--tls-key", settings.tls_key)
        if tls.enabled:
            tls.server_credentials()
        token = read_token(settings.auth_token_file) if settings.auth_token_file else None
    except FabricError as exc:
        fail(str(exc))
    return tls, token


def load_peer_token(settings: NodeSettings, token: str | None, policy: PolicyFile | None) -> str | None:
    """The token this node sends its members (``--peer-token-file``); without it, ``--auth-token-file``'s where no policy is set.

    Under ``--policy`` the peer token never grants admin here: it may not be the cluster token, nor one the policy gives
    ``admin`` (a member that learnt it would hold every verb on this node). Each is one line at start.
    """
    try:
        peer_token = read_token(settings.peer_token_file) if settings.peer_token_file else None
    except FabricError as exc:
        fail(f"--peer-token-file: {exc}")
    if policy is None:
        return peer_token if peer_token is not None else token
    if peer_token is None:
        return None
    if token is not None and hmac.compare_digest(peer_token.encode(), token.encode()):
        fail("--peer-token-file holds the same token as --auth-token-file: under --policy that token is the all-powerful "
             "cluster-token principal, and a node's peer token must not be; give the nodes a peer token of their own "
             "(a principal with read and pull, like the README's 'peers')")
    found = policy.policy.by_token(peer_token)
    if found is not None and found.may_anywhere("admin"):
        fail(f"--peer-token-file: the token is principal {found.name!r}'s, which this node's --policy grants admin; a peer token "
             f"must not grant admin (give it read and pull)")
    return peer_token


def membership(settings: NodeSettings, tls: TlsFiles, peer_token: str | None, view: MemberView | None = None) -> Membership:
    """Who gets this node's peer token and client certificate: --peers, what --peers-dns resolves to (with placement: the
    fleet's ``view``, which --peers-k8s adds to), and with --tls-ca and --peer-tls-name any server whose certificate proves
    that name (``adapter_fabric.transport.membership``)."""
    dns = settings.peers_dns
    return Membership(
        settings.peers,
        (lambda: resolve(dns)) if dns and view is None else None,
        proven_by_certificate=tls.enabled and tls.ca is not None and bool(settings.peer_tls_name),
        anonymous_non_members=settings.non_member_peers == "anonymous",
        has_credential=peer_token is not None or tls.cert is not None,
        view=view,
    )


def load_policy(settings: NodeSettings) -> PolicyFile | None:
    """The --policy file, parsed strictly now: a broken one stops the node with one line naming the problem."""
    if settings.policy is None:
        return None
    try:
        return PolicyFile(settings.policy)
    except FabricError as exc:
        fail(f"--policy {exc}")


def open_store(
    settings: NodeSettings, trusted: TrustedSigners, policy: PolicyFile | None, *, on_export_change=None, on_damage=None
) -> AdapterStore:
    """The store at --store, recovered after a crash; an unusable path is one line.

    ``on_export_change`` and ``on_damage``: as ``AdapterStore``'s (a driven engine's wake-up; the repairs' queue).

    ``trusted`` (--trusted-signers) is known first: the export directory then lists only adapters they signed,
    and withdraws at once an entry of one they did not (staged before the node trusted signers). ``policy``'s
    ``[[quota]]`` tables are the per-tenant quotas (a reload hands the store the new ones).
    """
    claim_store(settings)  # before the store's recovery: a second node's would clean up the first one's work
    try:
        return AdapterStore(
            settings.store,
            chunk_size=settings.chunk_size,
            max_bytes=settings.max_store_bytes or None,
            max_adapter_bytes=settings.max_adapter_bytes,
            max_header_bytes=settings.max_header_bytes,
            export_dir=settings.export_dir,
            trusted=trusted,
            tenant_quotas=policy.policy.quotas if policy is not None else (),
            collect_at_open=False,  # the node collects once serving: not on the path to SERVING (node.background)
            on_export_change=on_export_change,
            on_damage=on_damage,
        )
    except OSError as exc:
        fail(f"--store {settings.store}: cannot use it as the store directory: {exc.strerror or exc}")
    except FabricError as exc:
        fail(f"--store {settings.store}: {exc}")


#: the file naming the node that holds the store (written once it listens); the lock itself is on the directory
NODE_LOCK = "node.lock"
_held: list[int] = []  # the store directory's descriptor, kept open (so locked) until the process exits


def claim_store(settings: NodeSettings) -> None:
    """Refuse a --store another running fabric-node uses, naming it: two nodes on one store would each take the other's
    uploads and partial downloads for abandoned ones, and each other's recovery would remove what the other writes.

    The lock is an ``flock`` on the store directory itself, held for the process's life: taking it writes nothing, so a
    start refused for another reason (a store of another format, a bad flag) leaves the store as it was.
    """
    try:
        settings.store.mkdir(parents=True, exist_ok=True)
        fd = os.open(settings.store, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        fail(f"--store {settings.store}: cannot use it as the store directory: {exc.strerror or exc}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            holder = (settings.store / NODE_LOCK).read_text(errors="replace").strip()
        except OSError:
            holder = ""
        fail(f"--store {settings.store} is in use by another fabric-node ({holder[:300] or 'still starting'}): give each node its own --store")
    _held.append(fd)


def name_store_holder(settings: NodeSettings, address: str) -> None:
    """Write who holds the store into ``node.lock``, for a second node's refusal to name (once this node listens)."""
    try:
        (settings.store / NODE_LOCK).write_text(f"pid {os.getpid()}, listening on {address}\n")
    except OSError:
        pass  # the name is a courtesy: the lock is the directory's


def load_trusted(settings: NodeSettings) -> TrustedSigners:
    """The --trusted-signers keys, read now so a bad file stops the node at start."""
    try:
        return TrustedSigners.from_files(settings.trusted_signers)
    except FabricError as exc:
        fail(str(exc))


def build_model(settings: NodeSettings) -> MultiLoraModel | None:
    """The multi-adapter model, or None for a store-only node (which never imports torch)."""
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


def start_endpoint(settings: NodeSettings, ready: Callable[[], bool]) -> ProbeEndpoint | None:
    """The plain-HTTP /metrics, /healthz and /readyz listener (--metrics-listen), first of all: /healthz answers from here on."""
    if not settings.metrics_listen:
        return None
    check_bindable("--metrics-listen", settings.metrics_listen)
    host, _, port = settings.metrics_listen.rpartition(":")
    try:
        return ProbeEndpoint(host, int(port), ready, read_timeout=settings.metrics_read_timeout).start()
    except OSError as exc:
        fail(f"--metrics-listen {settings.metrics_listen}: cannot listen there: {exc.strerror or exc}")


def listen_data_channel(settings: NodeSettings) -> socket.socket | None:
    """The data channel's socket on --listen's host (unless --data-port off), listening now: its port is announced in replies."""
    if settings.data_port < 0:
        return None
    host = settings.listen.rsplit(":", 1)[0].strip("[]")
    try:
        return listen_socket(host, settings.data_port)
    except OSError as exc:
        fail(f"--data-port {settings.data_port}: cannot listen on {host}:{settings.data_port}: {exc.strerror or exc}")


def check_bindable(flag: str, listen: str) -> None:
    """Refuse an address another process holds, or one that is not this machine's, before gRPC tries it.

    gRPC's own bind reuses ports by default (two nodes then share one port) and
    reports failures in several lines; this probe gives one line naming the flag.
    """
    host, _, port_text = listen.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    try:
        infos = socket.getaddrinfo(None if host in ("", "*") else host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        fail(f"{flag} {listen}: the host {host!r} does not resolve ({getattr(exc, 'strerror', None) or exc}); expected HOST:PORT of this machine")
    if port == 0:
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT leftovers are not "in use"
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    fail(f"{flag} {listen}: port {port} is already in use on {address[0]} (another process listens there); stop it or pick another port")
                if exc.errno == errno.EADDRNOTAVAIL:
                    fail(f"{flag} {listen}: {address[0]} is not an address of this machine")
                fail(f"{flag} {listen}: cannot listen there: {exc.strerror}")


def bind(server: grpc.aio.Server, settings: NodeSettings, credentials: grpc.ServerCredentials | None) -> int:
    """Add the --listen port to ``server`` (port reuse is off in its options); the bound port."""
    check_bindable("--listen", settings.listen)
    try:
        port = server.add_secure_port(settings.listen, credentials) if credentials is not None else server.add_insecure_port(settings.listen)
    except RuntimeError:
        port = 0
    if port == 0:
        fail(f"--listen {settings.listen}: cannot listen there (in use, or not an address of this machine)")
    return port
