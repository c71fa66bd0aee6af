"""What a Fetch stream's metadata says beside its chunks: the chunks a serving node picked, and what it holds.

Initial metadata ``fabric-picked-chunks``: the chunk indexes (comma-separated)
a node serving a request with ``accept_bitmap`` will send, so the caller knows
before the bytes arrive (and asks no one else for them meanwhile). Beside it, a node holding the whole adapter says
``fabric-other-pullers``: how many other nodes pulled it from there lately (``recent_pullers``); absent from older nodes.

Trailing metadata, on a stream that ended well: ``fabric-complete: 1`` from a
node holding every chunk, or ``fabric-verified-bin`` (its verified_bitmap, as
Availability answers) from one still receiving the adapter, so a swarm
puller learns what its source holds without polling Availability.

Request metadata of a node that is itself pulling the adapter (BitTorrent's
HAVE, riding on the request): ``fabric-holder-port`` (the port it serves on)
and ``fabric-holder-bin`` (its verified_bitmap). The serving node, when it
pulls the same adapter, takes that as an Availability answer from the peer
at the connection's address and that port, so every Fetch informs both ends
and polls are left for the peers a node exchanges nothing with. Hints are
advisory: a peer that lies is asked for chunks it lacks and dropped as usual.

``fabric-data-port``, in the initial metadata of GetManifest and Availability
replies and in a Fetch's trailer: the port of the node's data channel
(``adapter_fabric.transport.data_channel``) on the same host; absent when it has none.
"""

from __future__ import annotations

from typing import Any

from adapter_fabric.errors import IntegrityError

PICKED_CHUNKS_KEY = "fabric-picked-chunks"
OTHER_PULLERS_KEY = "fabric-other-pullers"
VERIFIED_KEY = "fabric-verified-bin"
COMPLETE_KEY = "fabric-complete"
HOLDER_PORT_KEY = "fabric-holder-port"
HOLDER_BITMAP_KEY = "fabric-holder-bin"
DATA_PORT_KEY = "fabric-data-port"


def picked(chunks: list[int], others: int | None = None) -> tuple[tuple[str, str], ...]:
    """Initial metadata announcing the chunks a serving node will send, and how many others pull the adapter from it."""
    told = ((OTHER_PULLERS_KEY, str(others)),) if others is not None else ()
    return ((PICKED_CHUNKS_KEY, ",".join(map(str, chunks))), *told)


def other_pullers(metadata: Any) -> int | None:
    """How many other pullers a serving node said it has lately; None when it did not say (or said nonsense)."""
    for key, value in metadata or ():
        if key == OTHER_PULLERS_KEY:
            return int(value) if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 10 else None
    return None


def picked_chunks(metadata: Any) -> list[int] | None:
    """The chunks a serving node announced it will send; None when it did not say."""
    for key, value in metadata or ():
        if key == PICKED_CHUNKS_KEY:
            try:
                return [int(c) for c in value.split(",") if c]
            except ValueError:
                raise IntegrityError(f"malformed {key} metadata {value[:100]!r}") from None
    return None


def complete() -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a node holding every chunk."""
    return ((COMPLETE_KEY, "1"),)


def verified(bitmap: bytes) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata of a node still receiving: the chunks it holds verified."""
    return ((VERIFIED_KEY, bitmap),)


def holding(metadata: Any) -> tuple[bytes | None, bool]:
    """``(verified bitmap or None, complete)`` from a Fetch's trailing metadata; ``(None, False)`` when it says neither."""
    bitmap, whole = None, False
    for key, value in metadata or ():
        if key == VERIFIED_KEY:
            bitmap = bytes(value)
        elif key == COMPLETE_KEY:
            whole = value == "1"
    return bitmap, whole


def holder(port: int, bitmap: bytes) -> tuple[tuple[str, str | bytes], ...]:
    """Request metadata of a puller serving on ``port`` that holds ``bitmap`` of the adapter it asks for."""
    return ((HOLDER_PORT_KEY, str(port)), (HOLDER_BITMAP_KEY, bitmap))


def holder_of(metadata: Any, peer: str) -> tuple[str, int, bytes] | None:
    """``(host, port, bitmap)`` of a requesting puller (``peer``: gRPC's ``ipv4:H:P`` / ``ipv6:[H]:P``); None when not said."""
    port = bitmap = None
    for key, value in metadata or ():
        if key == HOLDER_PORT_KEY and isinstance(value, str) and value.isdigit() and 0 < int(value) < 65536:
            port = int(value)
        elif key == HOLDER_BITMAP_KEY and isinstance(value, bytes):
            bitmap = value
    kind, _, address = peer.partition(":")
    if port is None or bitmap is None or kind not in ("ipv4", "ipv6"):
        return None
    host = address.rpartition(":")[0]
    return (host[1:-1] if host.startswith("[") else host), port, bitmap


def announce_data_port(port: int) -> tuple[tuple[str, str], ...]:
    """Metadata announcing this node's data channel port (nothing when it has none)."""
    return ((DATA_PORT_KEY, str(port)),) if port > 0 else ()


def data_port(metadata: Any) -> int | None:
    """The data channel port a reply announced; None when it announced none (or nonsense)."""
    for key, value in metadata or ():
        if key == DATA_PORT_KEY and isinstance(value, str) and value.isdigit() and 0 < int(value) < 65536:
            return int(value)
    return None
