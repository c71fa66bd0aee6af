"""Upload slots: how many Fetch streams a node sends at once (``--upload-slots``).

A node that serves every stream at once splits its link among them all: at a rollout's start the seed sends the first
chunk of fifteen pullers at a fifteenth of its link each, all of them land late together, and no puller has anything
to trade before they do. With a few slots (BitTorrent's unchoked uploads) each stream gets a larger share, its chunks
land sooner, and the swarm starts trading earlier (docs/BENCHMARKS.md, "upload slots").

Streams past the slots wait in turn on the event loop (no buffer, no file: only their connection and their count under
``--max-streams-per-peer``, as any stream). A stream that waited ``SLOT_WAIT_S`` sends
anyway (``fabric_upload_slot_waits_total{outcome="past_bound"}``): a peer that holds slots by reading slowly delays
the others by that much at most and starves none; the stall cut and ``--max-streams-per-peer`` bound it as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from adapter_fabric.observability.metrics import UPLOAD_SLOT_WAITS

__all__ = ["SLOT_WAIT_S", "UPLOAD_SLOTS", "UploadSlots"]

#: streams a node sends at once by default: measured on 16 nodes at 200 Mbit/s, 8 beat 2 and 4 and no bound (bench_swarm)
UPLOAD_SLOTS = 8
#: seconds a stream waits for a slot before it sends without one: above a few chunks' time on a busy link, and
#: within the swarm's patience (its endgame duplicates a request only after ``swarm.ENDGAME_MIN_S``)
SLOT_WAIT_S = 1.0


class UploadSlots:
    """At most ``slots`` holders at once, in the order they asked; one that waited ``wait_s`` goes on without a slot."""

    def __init__(self, slots: int = UPLOAD_SLOTS, wait_s: float = SLOT_WAIT_S) -> None:
        self._free = asyncio.Semaphore(slots)  # first come, first served; bound to the event loop at its first wait
        self._wait_s = wait_s

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot (or, after the wait bound, none) for the body: a stream's whole send."""
        held = True
        if self._free.locked():
            try:
                async with asyncio.timeout(self._wait_s):
                    await self._free.acquire()
                UPLOAD_SLOT_WAITS.labels("queued").inc()
            except TimeoutError:
                held = False
                UPLOAD_SLOT_WAITS.labels("past_bound").inc()
        else:
            await self._free.acquire()  # free: returns at once
        try:
            yield
        finally:
            if held:
                self._free.release()
