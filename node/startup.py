"""Start-up checks: each bad flag or file stops the node with one line naming it and what it needs.

Everything here runs before the node says "listening"; a failure raises
``SystemExit`` through ``adapter_fabric.node.settings.fail`` (one line on stderr, status 1),
never a traceback, and leaves no state behind.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import grpc

from adapter_fabric.access.policy_file import PolicyFile
from adapter_fabric.errors import FabricError
from adapter_fabric.rpc.security import TlsFiles, read_token
from adapter_fabric.store import AdapterStore
from adapter_fabric.trust.signing import TrustedSigners
from adapter_fabric.node.settings import NodeSettings, fail

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


def load_policy(settings: NodeSettings) -> PolicyFile | None:
    """The --policy file, parsed strictly now: a broken one stops the node with one line naming the problem."""
    if settings.policy is None:
        return None
    try:
        return PolicyFile(settings.policy)
    except FabricError as exc:
        fail(f"--policy {exc}")


def open_store(settings: NodeSettings, trusted: TrustedSigners, policy: PolicyFile | None) -> AdapterStore:
    """The store at --store, recovered after a crash; an unusable path is one line.

    ``trusted`` (--trusted-signers) is known first: the export directory then lists only adapters they signed,
    and withdraws at once an entry of one they did not (staged before the node trusted signers). ``policy``'s
    ``[[quota]]`` tables are the per-tenant quotas (a reload hands the store the new ones).
    """
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
        )
    except OSError as exc:
        fail(f"--store {settings.store}: cannot use it as the store directory: {exc.strerror or exc}")
    except FabricError as exc:
        fail(f"--store {settings.store}: {exc}")
