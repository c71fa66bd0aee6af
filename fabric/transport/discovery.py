"""Who the peers are: a static list, and/or one DNS name that resolves to many addresses.

No membership protocol of our own: a Kubernetes headless service (or any DNS
name with several A/AAAA records) already lists the nodes, so the node
re-resolves the name whenever it needs its peers (each pull, each Locate).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from fabric.errors import InvalidArgument

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


@dataclass(frozen=True)
class PeerSource:
    """A node's known peers: ``static`` as given, plus what ``dns`` resolves to now; ``me`` is left out."""

    static: tuple[str, ...] = ()
    dns: str = ""  # NAME:PORT, or empty
    me: str = ""  # this node's own address, as peers would name it

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
        return [p for p in dict.fromkeys(found) if p != self.me]
