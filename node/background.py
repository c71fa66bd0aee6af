"""The node's background jobs, each a coroutine a ``Node`` starts and cancels: expiry of abandoned entries, the restart's
garbage collection, the policy file's poll, and the wait for peers' streams to end before a drained server stops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from adapter_fabric.errors import FabricError
from adapter_fabric.node.peer_reads import DRAIN_CUT_MARGIN_S
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.store import AdapterStore

log = logging.getLogger("fabric.node")


def start(job: Coroutine[Any, Any, None]) -> asyncio.Task:
    """``job`` as a task of the node's; one that fails is said at once (ERROR, with its traceback). A task held until it
    is cancelled at drain is never awaited, so its exception would otherwise show only as the loop's "never retrieved"
    at exit, long after the job stopped."""
    task = asyncio.create_task(job, name=getattr(job, "__qualname__", "background job"))
    task.add_done_callback(_say_if_failed)
    return task


def _say_if_failed(task: asyncio.Task) -> None:
    if not task.cancelled() and (failure := task.exception()) is not None:
        log.error("background job %s failed, and no longer runs", task.get_name(), exc_info=failure)


#: how often abandoned uploads and partials are looked for, at most (and at least)
HYGIENE_INTERVAL_MAX_S = 600.0
HYGIENE_INTERVAL_MIN_S = 0.5
#: how often the --policy file is checked for a change (SIGHUP reloads it at once)
POLICY_POLL_S = 2.0
#: a draining node stops listening once no Fetch stream has been open this long (a receiver's next request hears why first)
DRAIN_LINGER_S = 0.5
#: ... and this long while a host that was reading at the signal has not yet been refused (a loaded receiver is slow to ask)
DRAIN_LINGER_UNHEARD_S = 3.0
DRAIN_POLL_S = 0.05

Io = Callable[..., Awaitable]


def expire(store: AdapterStore, max_age: float) -> None:
    """Remove uploads and partial downloads abandoned for ``max_age`` seconds, logging and counting each."""
    for item in store.expire_abandoned(max_age):
        metrics.EXPIRED.labels(item.kind).inc()
        metrics.EXPIRED_BYTES.inc(item.bytes)
        event(log, f"expired abandoned {item.kind}", kind=item.kind, adapter=item.adapter_id or None, digest=item.digest or None,
              bytes=item.bytes, age_s=round(item.age_seconds, 1))


async def expire_periodically(store: AdapterStore, max_age: float, io: Io) -> None:
    interval = min(HYGIENE_INTERVAL_MAX_S, max(HYGIENE_INTERVAL_MIN_S, max_age / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            await io(expire, store, max_age)
        except OSError as exc:  # a full or failing disk: say so, and try again next round
            log.warning("expiring abandoned uploads and partials failed: %s", exc)


async def collect_garbage(store: AdapterStore, io: Io) -> None:
    """What no ref reaches after a restart goes, on an I/O thread once the node serves (it holds the store's lock)."""
    started = time.monotonic()
    try:
        await io(store.collect_garbage)
    except (OSError, FabricError) as exc:  # a damaged or vanishing store: later collections read it whole again
        log.warning("collecting what no ref reaches after the restart failed: %s", exc)
        return
    log.info("collected what no ref reaches after the restart in %.1fs", time.monotonic() - started)


async def streams_ended(streams: PeerStreamLimit, within: float) -> None:
    """Return once no Fetch stream has been open for DRAIN_LINGER_S (a receiver between two requests hears the refusal), or
    DRAIN_LINGER_UNHEARD_S while a host reading at the signal has not been refused yet, or
    after ``within`` seconds less the margin ``PeerReads`` keeps to cut the last ones by name.

    The quiet is counted from the last stream's end, not from the signal: a node no peer was reading from stops at once.
    """
    loop = asyncio.get_running_loop()  # its clock is time.monotonic, as PeerStreamLimit.last_ended's
    give_up = loop.time() + max(0.0, within - min(DRAIN_CUT_MARGIN_S, within / 2))
    while True:
        quiet_since = streams.last_ended if streams.last_ended is not None else float("-inf")
        if streams.streams_open:
            quiet_since = loop.time()
        linger = DRAIN_LINGER_UNHEARD_S if streams.unheard else DRAIN_LINGER_S
        if loop.time() - quiet_since >= linger or loop.time() >= give_up:
            return
        await asyncio.sleep(DRAIN_POLL_S)
