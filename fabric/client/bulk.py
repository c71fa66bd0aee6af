"""Bulk publishing: many adapters staged through one node at once (``NodeClient.stage_many``, ``fabric stage-many``).

Each adapter is its own Stage call, as ``NodeClient.stage`` sends it, with
its own durability: a Stage that returned is committed on the node's disk.
Running ``workers`` of them at a time lets the node commit them together (its
committer syncs a batch of concurrent commits with one journal flush instead
of one per adapter: ``adapter_fabric.store.committer``), which is where one-at-a-time
staging spends its time. A failure is one adapter's: it is named in the
result beside the error, and every other adapter is committed or refused on
its own.

An adapter of one upload piece (most published adapters: a few MB at most) goes on one StageMany stream
instead (``streamed``: ``adapter_fabric.client.stage_stream``), which the node commits in groups as it arrives,
with the same durability: an adapter answered is committed. Against a node without StageMany, such an adapter is
a Stage that skips its UploadOffset call (``BatchStage``): resuming it would save at most that piece, and the
call was a quarter of a small Stage's cost on the node.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from adapter_fabric.client.results import StageResult
from adapter_fabric.errors import FabricError, IntegrityError, InvalidArgument
from adapter_fabric.store.digests import WEIGHTS_FILE, whole_file_blake3
from adapter_fabric.v1 import fabric_pb2


class Stager(Protocol):
    """What ``BatchStage`` needs of a client (``NodeClient``)."""

    def upload_target(self, adapter_id: str, blake3: str) -> fabric_pb2.UploadOffsetResponse: ...

    def stage(self, adapter_dir: Path, adapter_id: str, *, timeout: float | None = ..., target: Any = ...) -> StageResult: ...

#: concurrent Stage calls by default, and at most: past ~32 the node's I/O threads are the limit, not its disk
DEFAULT_WORKERS = 16
MAX_WORKERS = 64
#: adapters one call takes: a larger batch is the caller's loop (the result lists every adapter)
MAX_ADAPTERS = 100_000


@dataclass(frozen=True)
class StageFailure:
    """An adapter a bulk stage could not commit, and why (the library's error, as a single stage raises it)."""

    adapter_id: str
    directory: str
    error: FabricError


@dataclass(frozen=True)
class BulkStageResult:
    """What a bulk stage committed (in the order given) and what it could not, each named."""

    staged: list[StageResult] = field(default_factory=list)
    failed: list[StageFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every adapter was committed."""
        return not self.failed


class BatchStage:
    """``NodeClient.stage`` for each adapter of a batch; one of one upload piece starts at byte 0 without asking UploadOffset.

    It uses the chunk size the node gave the batch's first UploadOffset. A node restarted meanwhile with another
    --chunk-size refuses the root declared at the old one (IntegrityError): that adapter is staged again, asking.
    """

    def __init__(self, client: Stager, timeout: float | None, piece_size: int) -> None:
        """``piece_size``: bytes of one Stage data message (``node_client.UPLOAD_PIECE``): a file this small gains nothing from a resume."""
        self.client = client
        self.timeout = timeout
        self.piece_size = piece_size
        self._first: fabric_pb2.UploadOffsetResponse | None = None  # the batch's first answer
        self._asking = threading.Lock()  # the batch's workers start together: one asks, the others wait for its answer

    def __call__(self, directory: Path, adapter_id: str) -> StageResult:
        weights = directory / WEIGHTS_FILE
        if not weights.is_file() or weights.stat().st_size > self.piece_size:
            return self.client.stage(directory, adapter_id, timeout=self.timeout)  # the refusal, or a resumable upload
        with self._asking:
            first = self._first
            if first is None:  # a small file: hashing it twice costs less than the call
                self._first = target = self.client.upload_target(adapter_id, whole_file_blake3(weights))
        if first is None:
            return self.client.stage(directory, adapter_id, timeout=self.timeout, target=target)  # its own answer: it may resume
        fresh = fabric_pb2.UploadOffsetResponse(offset=0, chunk_size=first.chunk_size, digest_scheme=first.digest_scheme)
        try:
            return self.client.stage(directory, adapter_id, timeout=self.timeout, target=fresh)
        except IntegrityError:
            self._first = None  # the node's chunk size may have changed (a restart): ask it again
            return self.client.stage(directory, adapter_id, timeout=self.timeout)


class Streamed(Protocol):
    """Publishes small adapters on one stream (``adapter_fabric.client.stage_stream.StreamStage``): each answered through
    ``done``; returns the pairs it left to ``stage`` (a node without the streaming call)."""

    def __call__(self, pairs: list[tuple[Path, str]], done: Callable[[str, StageResult | None, FabricError | None], None]) -> list[tuple[Path, str]]: ...


def stage_many(
    stage: Callable[[Path, str], StageResult],
    items: Iterable[tuple[str | Path, str]],
    workers: int = DEFAULT_WORKERS,
    on_done: Callable[[str, StageResult | None, FabricError | None], None] | None = None,
    *,
    streamed: Streamed | None = None,
    piece_size: int = 0,
) -> BulkStageResult:
    """Stage every ``(directory, adapter_id)`` with ``stage`` (``NodeClient.stage``), ``workers`` at a time.

    ``streamed``: the adapters whose weights are at most ``piece_size`` bytes go there instead (one StageMany stream); what
    it leaves (an older node) and the larger ones go to ``stage``.
    A library error stops only its adapter (``failed`` names it); anything else (a bug, Ctrl-C) propagates.
    ``on_done(adapter_id, result, error)`` is called as each ends, from the worker threads.
    """
    pairs = [(Path(d), i) for d, i in items]
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise InvalidArgument(f"workers {workers!r}: expected 1 to {MAX_WORKERS} concurrent stages")
    if len(pairs) > MAX_ADAPTERS:
        raise InvalidArgument(f"{len(pairs)} adapters in one bulk stage: at most {MAX_ADAPTERS}; split the list")
    ids = [adapter_id for _, adapter_id in pairs]
    if len(set(ids)) != len(ids):
        twice = sorted(i for i, n in Counter(ids).items() if n > 1)[:3]
        raise InvalidArgument(f"adapter ids appear twice in one bulk stage: {', '.join(twice)}; each id names one adapter")

    def one(pair: tuple[Path, str]) -> StageResult | StageFailure:
        directory, adapter_id = pair
        try:
            result: StageResult | StageFailure = stage(directory, adapter_id)
        except FabricError as exc:
            result = StageFailure(adapter_id, str(directory), exc)
        if on_done is not None:
            if isinstance(result, StageResult):
                on_done(adapter_id, result, None)
            else:
                on_done(adapter_id, None, result.error)
        return result

    ended: dict[str, StageResult | StageFailure] = {}
    rest = pairs
    if streamed is not None:
        directories = {adapter_id: directory for directory, adapter_id in pairs}

        def answered(adapter_id: str, result: StageResult | None, error: FabricError | None) -> None:
            ended[adapter_id] = result if result is not None else StageFailure(adapter_id, str(directories[adapter_id]), error or FabricError("no answer"))
            if on_done is not None:
                on_done(adapter_id, result, error)

        small = [(d, i) for d, i in pairs if _weights_size(d) <= piece_size]
        rest = [(d, i) for d, i in pairs if _weights_size(d) > piece_size] + (streamed(small, answered) if small else [])
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(rest))), thread_name_prefix="stage-many") as pool:
        for (_, adapter_id), outcome in zip(rest, pool.map(one, rest), strict=True):
            ended[adapter_id] = outcome
    outcomes = [ended[adapter_id] for _, adapter_id in pairs]
    return BulkStageResult(
        staged=[o for o in outcomes if isinstance(o, StageResult)], failed=[o for o in outcomes if isinstance(o, StageFailure)]
    )


def _weights_size(directory: Path) -> int:
    """The weights file's size; a directory without one goes to ``stage``, whose refusal names what is missing."""
    try:
        return (directory / WEIGHTS_FILE).stat().st_size
    except OSError:
        return 1 << 62
