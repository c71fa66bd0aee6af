"""The flags every node command shares (address, TLS, token) and the client they make."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from adapter_fabric.client.addresses import check_address
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import InvalidArgument
from adapter_fabric.units import parse_duration


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-ca/--tls-cert/--tls-key/--auth-token-file, each defaulting to its environment variable."""
    g = parser.add_argument_group("security (each also from its environment variable)")
    g.add_argument("--tls-ca", default=os.environ.get("FABRIC_TLS_CA"), help="PEM CA that signed the node's certificate: turns on TLS [FABRIC_TLS_CA]")
    g.add_argument("--tls-cert", default=os.environ.get("FABRIC_TLS_CERT"), help="PEM client certificate, for nodes that require mutual TLS [FABRIC_TLS_CERT]")
    g.add_argument("--tls-key", default=os.environ.get("FABRIC_TLS_KEY"), help="PEM key of --tls-cert [FABRIC_TLS_KEY]")
    g.add_argument(
        "--auth-token-file",
        default=os.environ.get("FABRIC_AUTH_TOKEN_FILE"),
        help="file with the cluster's bearer token [FABRIC_AUTH_TOKEN_FILE; or the token itself in FABRIC_AUTH_TOKEN]",
    )


def client_for(args: argparse.Namespace, address: str | None = None, *, timeout: float | None = None) -> NodeClient:
    """A client of ``address`` (default: the command's NODE) with the command's TLS files and token.

    ``timeout``: the deadline of the calls that move adapters (--timeout; 0 or None = no deadline).
    """
    from adapter_fabric.rpc.security import TlsFiles, check_token, read_token

    tls = TlsFiles(_path(args.tls_cert), _path(args.tls_key), _path(args.tls_ca))
    if args.auth_token_file:
        token = read_token(args.auth_token_file)
    elif os.environ.get("FABRIC_AUTH_TOKEN"):
        token = check_token(os.environ["FABRIC_AUTH_TOKEN"], "FABRIC_AUTH_TOKEN")
    else:
        token = None
    return NodeClient(address or args.node, tls=tls if tls.enabled else None, token=token, long_timeout=timeout or None)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def node_address(text: str) -> str:
    """An argparse type: ``host:port`` (a bare host is a usage error, not a silent dial of port 443)."""
    try:
        return check_address(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def peer_address(text: str) -> str:
    """An argparse type for ``--from``: a peer's ``host:port`` (a node dials its peers over TCP: a unix socket is a usage error)."""
    if text.startswith(("unix:", "unix-abstract:")):
        raise argparse.ArgumentTypeError(f"peer address {text[:200]!r} is a unix socket; a node reaches its peers at host:port")
    return node_address(text)


def duration_arg(text: str) -> float:
    """An argparse type: seconds as ``30``, ``30s``, ``15m``, ``1h`` (adapter_fabric.units); negative, nan, inf or past a year is a usage error."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
