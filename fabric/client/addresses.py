"""Node addresses as users type them, and what to say when one cannot be reached."""

from __future__ import annotations

import re

from adapter_fabric.errors import InvalidArgument

# host:port, [v6]:port, or a unix socket; gRPC would dial port 443 for a bare host, silently.
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})")


def check_address(address: str) -> str:
    """``address`` if it names a port (``host:port``, ``[v6]:port``, ``unix:PATH``), else ``InvalidArgument``."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    match = _HOST_PORT.fullmatch(address)
    if match is not None and not 0 < int(match.group(1)) < 65536:
        raise InvalidArgument(f"node address {address!r}: port {int(match.group(1))} is out of range; a port is 1 to 65535 (e.g. 127.0.0.1:50051)")
    if match is None:
        host, colon, port = address.rpartition(":")
        if colon and host and port and not port.isdigit():
            why = f"port {port[:20]!r} is not a number"
        elif not colon or not port:
            why = "it names no port, and a bare host is not dialled on a default port"
        elif not host:
            why = "it names no host"
        else:
            why = f"host {host[:100]!r} is not a host name or an address ([v6 address]:port for IPv6)"
        raise InvalidArgument(f"node address {address[:200]!r} must be host:port (e.g. 127.0.0.1:50051): {why}")
    return address


#: what gRPC's resolvers (c-ares, the native one) say when a host name does not resolve
_NAME_NOT_FOUND = ("domain name not found", "name resolution", "dns resolution failed", "errors resolving", "hostname lookup error")
#: the hint for a host name that does not resolve (TLS or a running node has nothing to do with it)
NAME_HINT = "its host name does not resolve: check the spelling, or use the node's IP address"
#: the hint for a refused connection (a node not started yet, or stopped)
WAIT_HINT = "is fabric-node running and listening there? (`fabric wait NODE` waits for it)"


def unreachable_hint(details: str, *, tls: bool, client_cert: bool) -> str:
    """What a person can change when a node's transport fails (gRPC UNAVAILABLE with no fabric error inside)."""
    text = details.lower()
    if any(sign in text for sign in _NAME_NOT_FOUND):
        return NAME_HINT
    if "connection refused" in text:
        return WAIT_HINT
    if not tls:
        return (
            "if the node serves TLS, pass --tls-ca FILE (or FABRIC_TLS_CA), and --tls-cert/--tls-key "
            "(FABRIC_TLS_CERT/FABRIC_TLS_KEY) when it requires client certificates"
        )
    if not client_cert:
        return "the node may require a client certificate (mutual TLS): pass --tls-cert and --tls-key (or FABRIC_TLS_CERT, FABRIC_TLS_KEY)"
    return "check that --tls-ca (FABRIC_TLS_CA) signed the node's certificate, the node's CA signed --tls-cert, and the certificate names this address"
