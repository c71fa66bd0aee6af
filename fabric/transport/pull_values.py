"""The plain values a pull is given and gives back: its settings and its statistics.

``PeerPuller`` builds one ``PullSettings`` from its constructor arguments and
hands it to every download it runs; each download fills one ``PullStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STALL_TIMEOUT_S", "PullSettings", "PullStats"]

#: a peer that sends nothing for this long is cancelled and the pull moves on (a slow peer that keeps sending is fine)
STALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PullSettings:
    """How a node pulls: fixed for the puller's life, shared by all its downloads."""

    #: seconds a Fetch stream may deliver nothing before its peer is dropped; also how long a pull waits for any progress
    stall_timeout: float = STALL_TIMEOUT_S
    #: requests outstanding per peer; None: ``swarm.window_for``'s (two on a pull's only source, else one)
    window: int | None = None
    #: the port this node serves on, sent with each Fetch so the serving peer learns what this node holds (0: not a node)
    listen_port: int = 0
    #: bytes per second this node receives over all its pulls together (0: no limit); one token bucket enforces it
    download_rate: int = 0


@dataclass
class PullStats:
    """What one pull did: what it moved and from whom (for logs, tests and the Promote reply)."""

    digest: str = ""
    bytes_transferred: int = 0
    resumed_from: int = 0
    source_peers: list[str] = field(default_factory=list)
    corrupt_chunks: int = 0
    failovers: int = 0  # peers dropped while chunks were still missing
    shared: bool = False  # this caller joined a download another caller started
    #: the pull made its id refer to the digest here (a download committed, or bytes held under another id put under it):
    #: the id's homes are told. False when the id referred to it already, or a joined download committed it under this id.
    referred: bool = False
    endgame_requests: int = 0  # requests that duplicated a slow one near the end
    pull_seconds: float = 0.0
    peer_bytes: dict[str, int] = field(default_factory=dict)  # verified bytes received, by source peer (metrics)
