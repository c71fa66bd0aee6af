"""StageMany's hold-back: a stream whose commits cannot keep up stops reading at ``MAX_STREAM_BYTES`` held uncommitted
(gRPC's flow control then holds the client), and reads on as each group's commit gives its bytes back.

In process, on the node's own ``StageMany``: its I/O threads are replaced by a gate the test opens, so "the commits cannot
keep up" is a state the test holds, not a race it hopes for. The commits themselves, and the same path through a real
node process, are tests/node/test_stage_many.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

from adapter_fabric.errors import Busy
from adapter_fabric.node.stage_many import MAX_ADAPTER_BYTES, MAX_STREAM_BYTES, StageMany
from adapter_fabric.v1 import fabric_pb2

ADAPTERS = 3 * MAX_STREAM_BYTES // MAX_ADAPTER_BYTES  # three bounds' worth of 1 MiB adapters
HELD = MAX_STREAM_BYTES // MAX_ADAPTER_BYTES  # adapters that fit the bound


class GatedCommits:
    """The node's I/O threads, held shut until ``opened``: each batch then 'commits' as refused (no store here)."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.batches: list[int] = []

    async def io(self, commit: Callable, batch: list, who: object) -> None:
        await self.opened.wait()
        self.batches.append(len(batch))
        for item in batch:
            item.outcome = Busy("held by the test")


async def _settle() -> None:
    """Let every ready task run until none is (the reader either blocked on the bound or read everything)."""
    for _ in range(200):
        await asyncio.sleep(0)


async def test_a_stream_stops_reading_at_its_bound_of_uncommitted_bytes_and_reads_on_as_commits_land() -> None:
    consumed = 0

    async def requests() -> AsyncIterator[fabric_pb2.StageManyRequest]:
        nonlocal consumed
        for i in range(ADAPTERS):
            consumed += 1
            begin = fabric_pb2.StageBegin(adapter_id=f"team-a/small-{i}", safetensors_size=MAX_ADAPTER_BYTES)
            yield fabric_pb2.StageManyRequest(begin=begin, data=bytes(MAX_ADAPTER_BYTES))

    commits = GatedCommits()
    stream = StageMany(SimpleNamespace(context=commits, on_staged=None)).stage_many(requests())
    first = asyncio.ensure_future(anext(stream))
    await _settle()
    # The reader took the adapters that fit and one more, which waits for room: no byte past the bound is held.
    assert consumed == HELD + 1, f"{consumed} adapters read with no commit done; the bound holds {HELD}"

    commits.opened.set()
    results = [await first] + [result async for result in stream]
    assert consumed == ADAPTERS and len(results) == ADAPTERS
    assert all(result.error.kind == "Busy" for result in results)
    assert max(commits.batches) <= HELD
