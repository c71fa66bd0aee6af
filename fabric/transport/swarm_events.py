"""What a swarm download's workers report to its coordinator: one small frozen value per kind of event.

Workers (``adapter_fabric.transport.swarm_fetch``) put these on the download's queue;
the coordinator (``adapter_fabric.transport.swarm_pull``) dispatches each by its type
to one handler. ``trace_row`` is the event as the pull trace records it
(``FABRIC_PULL_TRACE``; scripts/bench_swarm.py reads it), None when untraced.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar

from adapter_fabric.errors import FabricError
from adapter_fabric.transport import swarm

__all__ = [
    "ChunkVerified", "ChunksPicked", "DuplicateChunk", "FetchBroken", "FetchBusy", "FetchCancelled", "FetchCorrupt",
    "FetchDone", "FetchEnded", "FetchFailed", "FetchMissing", "HoldingHinted", "HoldingNews", "HoldingReported",
    "PollFailed", "Polled", "SwarmEvent",
]


# ---------------------------------------------------------------- during a Fetch stream


@dataclass(frozen=True)
class ChunkVerified:
    """A worker verified and wrote ``chunk``, one of ``request``'s (or one the peer picked instead)."""

    request: swarm.Request
    chunk: int

    def trace_row(self) -> list | None:
        """``[event, peer, chunks]`` for the pull trace."""
        return ["chunk", self.request.peer, [self.chunk]]


@dataclass(frozen=True)
class ChunksPicked:
    """The serving peer said it sends ``chunks`` in place of those ``request`` asked for (super-seeding), and how many
    ``others`` pull the adapter from it lately (None: it did not say)."""

    request: swarm.Request
    chunks: list[int]
    others: int | None = None

    def trace_row(self) -> list | None:
        """Not traced."""
        return None


@dataclass(frozen=True)
class DuplicateChunk:
    """``chunk`` arrived on ``request``'s stream after another route had delivered it: dropped."""

    request: swarm.Request
    chunk: int

    def trace_row(self) -> list | None:
        """``[event, peer, chunks]`` for the pull trace."""
        return ["dup", self.request.peer, [self.chunk]]


# ---------------------------------------------------------------- what a peer holds


@dataclass(frozen=True)
class HoldingNews:
    """What ``peer`` holds now: ``have`` (verified chunks), or all of them when ``complete``."""

    peer: str
    have: Collection[int]
    complete: bool

    label: ClassVar[str] = ""

    def trace_row(self) -> list | None:
        """``[event, peer, []]`` for the pull trace."""
        return [self.label, self.peer, []]


@dataclass(frozen=True)
class Polled(HoldingNews):
    """The answer to this download's Availability poll of ``peer``."""

    label: ClassVar[str] = "poll"


@dataclass(frozen=True)
class HoldingReported(HoldingNews):
    """A finished Fetch stream's trailer said what its peer holds: as good as a poll."""

    label: ClassVar[str] = "held"


@dataclass(frozen=True)
class HoldingHinted(HoldingNews):
    """A peer that fetches from this node said, on its request, what it holds: as good as a poll."""

    label: ClassVar[str] = "hint"


@dataclass(frozen=True)
class PollFailed:
    """An Availability poll of ``peer`` failed: the peer is dropped."""

    peer: str
    error: FabricError

    def trace_row(self) -> list | None:
        """Not traced."""
        return None


# ---------------------------------------------------------------- how a Fetch request ended


@dataclass(frozen=True)
class FetchEnded:
    """``request``'s stream is over; the subclass says how."""

    request: swarm.Request

    label: ClassVar[str] = ""

    def trace_row(self) -> list | None:
        """``[event, peer, chunks]`` for the pull trace."""
        return [self.label, self.request.peer, self.request.chunks]


@dataclass(frozen=True)
class FetchDone(FetchEnded):
    """Every chunk the request still needed arrived."""

    label: ClassVar[str] = "done"


@dataclass(frozen=True)
class FetchCancelled(FetchEnded):
    """This download cut the stream (a redundant endgame copy, a dropped peer, the pull ending)."""

    label: ClassVar[str] = "cancelled"


@dataclass(frozen=True)
class FetchEndedBy(FetchEnded):
    """A request its peer ended early (a refusal, a failure, bad bytes): ``error`` says why."""

    error: FabricError


@dataclass(frozen=True)
class FetchCorrupt(FetchEndedBy):
    """A chunk failed verification, came misplaced, or a message was malformed."""

    label: ClassVar[str] = "corrupt"


@dataclass(frozen=True)
class FetchMissing(FetchEndedBy):
    """The peer answered NOT_FOUND: it no longer holds chunks it announced."""

    label: ClassVar[str] = "missing"


@dataclass(frozen=True)
class FetchBusy(FetchEndedBy):
    """The peer refused the stream for now (RESOURCE_EXHAUSTED: its streams per peer, or a seed's first copies: ``QuotaExceeded.bound``)."""

    label: ClassVar[str] = "busy"


@dataclass(frozen=True)
class FetchBroken(FetchEndedBy):
    """The peer failed: an error, a stall, or a stream that ended short. The peer is dropped."""

    label: ClassVar[str] = "broken"


@dataclass(frozen=True)
class FetchFailed(FetchEnded):
    """A local failure (disk full, store closed): it ends the whole pull."""

    error: BaseException
    label: ClassVar[str] = "fatal"


SwarmEvent = (
    ChunkVerified | ChunksPicked | DuplicateChunk | Polled | HoldingReported | HoldingHinted | PollFailed
    | FetchDone | FetchCancelled | FetchCorrupt | FetchMissing | FetchBusy | FetchBroken | FetchFailed
)
