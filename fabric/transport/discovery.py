"""Who the peers are: a static list, and/or one DNS name that resolves to many addresses.

No membership protocol of our own: a Kubernetes headless service (or any DNS
name with several A/AAAA records) already lists the nodes, so the node
re-resolves the name whenever it needs its peers (each pull, each Locate).

A node never counts itself: a peer is this node when it names this node's port
and an address this node listens on, compared after resolving both (so
``--listen 0.0.0.0:P`` with a DNS name that resolves to the node's own pod IP,
or a static ``localhost:P``, is recognised), not by comparing the text.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from adapter_fabric.errors import InvalidArgument

log = logging.getLogger(__name__)


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); refuses anything else by name."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{value!r} is not host:port (for example peers.fabric.svc:50051)")
    return host.strip("[]"), int(port)


def resolve(name_port: str) -> list[str]:
    """Every address ``name`` resolves to, as ``ip:port`` (``[ip]:port`` for IPv6), in resolver order, no repeats."""
    host, port = split_host_port(name_port)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        addresses[f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"] = None
    return list(addresses)


#: listen hosts that mean "every address of this machine"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})


def _addresses(host: str) -> set[str]:
    """The IPs ``host`` resolves to (none when it does not resolve)."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def is_local_address(ip: str) -> bool:
    """Whether ``ip`` is one of this machine's own addresses: only those can be bound."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
        return True
    except OSError:
        return False


def is_self(peer: str, listen: str) -> bool:
    """Whether ``peer`` (HOST:PORT) reaches the node listening on ``listen`` (HOST:PORT, the bound port)."""
    try:
        peer_host, peer_port = split_host_port(peer)
        my_host, my_port = split_host_port(listen)
    except InvalidArgument:
        return peer == listen
    if peer_port != my_port:
        return False
    peer_ips = _addresses(peer_host)
    if my_host in WILDCARD_HOSTS:
        return any(is_local_address(ip) for ip in peer_ips)
    return bool(peer_ips & _addresses(my_host))


@dataclass(frozen=True)
class PeerSource:
    """A node's known peers: ``static`` as given, plus what ``dns`` resolves to now; this node itself is left out."""

    static: tuple[str, ...] = ()
    dns: str = ""  # NAME:PORT, or empty
    me: str = ""  # the address this node listens on (HOST:PORT with the bound port); a wildcard host means all of its addresses

    def __post_init__(self) -> None:
        if self.dns:
            split_host_port(self.dns)  # a malformed flag fails at start-up, not at the first pull

    def peers(self) -> list[str]:
        found = list(self.static)
        if self.dns:
            try:
                found += resolve(self.dns)
            except OSError as exc:  # a name with no records yet (a service scaling from zero) is not fatal
                log.warning("peer discovery: %s did not resolve (%s); using the static peers only", self.dns, exc)
        return [p for p in dict.fromkeys(found) if not (self.me and is_self(p, self.me))]
