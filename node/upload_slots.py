"""Upload slots: how many Fetch streams a node sends at once (``--upload-slots``).

A node that serves every stream at once splits its link among them all: at a rollout's start the seed sends the first
chunk of fifteen pullers at a fifteenth of its link each, all of them land late together, and no puller has anything
to trade before they do. With a few slots (BitTorrent's unchoked uploads) each stream gets a larger share, its chunks
land sooner, and the swarm starts trading earlier (docs/BENCHMARKS.md, "upload slots").

Streams past the slots wait in turn on the event loop (no buffer, no file: only their connection and their count under
``--max-streams-per-peer``, as any stream). A stream that waited ``SLOT_WAIT_S`` sends
anyway (``fabric_upload_slot_waits_total{outcome="past_bound"}``), and a stream holds its slot ``SLOT_LEASE_S`` at most:
a peer that holds slots by reading slowly keeps each for a second, then the next stream in turn takes it, so it delays
the others by about that much and starves none; the stall cut and ``--max-streams-per-peer`` bound it as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from adapter_fabric.observability.metrics import UPLOAD_SLOT_WAITS

__all__ = ["SLOT_LEASE_S", "SLOT_WAIT_S", "UPLOAD_SLOTS", "UploadSlots"]

#: streams a node sends at once by default: measured on 16 nodes at 200 Mbit/s, 8 beat 2, 4, 5, 12 and no bound (bench_swarm)
UPLOAD_SLOTS = 8
#: seconds a stream waits for a slot before it sends without one: above a few chunks' time on a busy link, and
#: within the swarm's patience (its endgame duplicates a request only after ``swarm.ENDGAME_MIN_S``)
SLOT_WAIT_S = 1.0
#: seconds a stream holds its slot at most; it then goes on without one. A swarm's one-chunk stream ends well within it
#: (0.05-0.35 s at 200 Mbit/s); a peer that holds slots by reading slowly keeps each for this long, not for its whole stream
SLOT_LEASE_S = 1.0


class UploadSlots:
    """At most ``slots`` holders at once, in the order they asked; one that waited ``wait_s`` goes on without a slot, and
    one that held its slot ``lease_s`` gives it back and goes on without."""

    def __init__(self, slots: int = UPLOAD_SLOTS, wait_s: float = SLOT_WAIT_S, lease_s: float = SLOT_LEASE_S) -> None:
        self._free = asyncio.Semaphore(slots)  # first come, first served; bound to the event loop at its first wait
        self._wait_s = wait_s
        self._lease_s = lease_s

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot (or, after the wait bound, none) for the body, a stream's send, until it ends or the lease does."""
        if not await self._take():
            yield  # waited the bound: sends without one
            return
        given_back = False

        def give_back() -> None:  # once: at the lease's end or the stream's, whichever comes first
            nonlocal given_back
            if not given_back:
                given_back = True
                self._free.release()

        lease = asyncio.get_running_loop().call_later(self._lease_s, give_back)
        try:
            yield
        finally:
            lease.cancel()
            give_back()

    async def _take(self) -> bool:
        """A slot, at once or in turn within the wait bound (True); False when the bound passed first."""
        if not self._free.locked():
            await self._free.acquire()  # free: returns at once
            return True
        try:
            async with asyncio.timeout(self._wait_s):
                await self._free.acquire()
        except TimeoutError:
            UPLOAD_SLOT_WAITS.labels("past_bound").inc()
            return False
        UPLOAD_SLOT_WAITS.labels("queued").inc()
        return True
