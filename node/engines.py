"""The engines' view: which adapters the inference engines beside this node have registered (--engine-url, --sglang-url).

vLLM reads a LoRA's directory again whenever its own CPU cache dropped the weights, so an exported
directory must stay while the engine names it. Each watched engine's ``GET /v1/models``
(``adapter_fabric.integrations.engine_models``: one deadline for the whole reply, a size, no redirects) is read
every ``POLL_S`` and right before an eviction; a card whose ``root`` is an entry of the export directory (its
name encodes the id) or whose name is an adapter id (an engine mounting the export volume elsewhere: the
fabric's resolver and driver name each adapter by its id) marks that id registered. Eviction holds registered
adapters (``ENGINE``); while an engine has not answered for ``STALE_S``, or its list was cut (too large to take
whole), every exported adapter (``ENGINE_UNKNOWN``, ``ENGINE_CUT``): what it may still read is unknown, so the
store refuses a commit, naming the engine, rather than pull a directory out from under it. ``fabric ls`` and the
metrics show each adapter's engines.

This is the node's one view of its engines: the SGLang it drives (--sglang-url, ``node.engine_drive``) is read
here too, by the drive's own rounds (``read``), not by the watcher's loop, so its list is read by one loop. A
driven engine is shown but holds nothing (the node unloads before it evicts). Each engine's state is logged once
per change (``StateLog``), and no reply, however odd, ends the watcher's task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from adapter_fabric.errors import FabricError, InvalidArgument
from adapter_fabric.integrations.engine_models import EngineList, EngineLoRA, engine_label, read_models
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import StateLog
from adapter_fabric.store.eviction import ENGINE, ENGINE_CUT, ENGINE_UNKNOWN
from adapter_fabric.store.export import adapter_id_of
from adapter_fabric.store.ids import validate_adapter_id

log = logging.getLogger("fabric.node")

#: seconds between reads of each watched engine's /v1/models
POLL_S = 10.0
#: an engine unanswered this long has registrations unknown: exported adapters are held until it answers
STALE_S = 300.0
#: what a listing adds to an engine whose last read failed (fabric ls: "engines: 127.0.0.1:8000 (not answering)")
NOT_ANSWERING = " (not answering: held as last read)"
#: bound on one read, whole (connect, TLS, headers and body)
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EngineState:
    """What one engine answered last, and when (replaced whole at each read: a reader on another thread sees one or the other)."""

    url: str
    label: str
    driven: bool = False  # the SGLang the node drives: read by its drive, shown, holding nothing
    adapters: tuple[EngineLoRA, ...] = ()
    ids: frozenset[str] = frozenset()
    cut: str = ""  # why its last list was not whole ("" when it was): every exported adapter is held meanwhile
    answered_at: float | None = None  # monotonic; None until the first answer
    error: str = ""  # why the last read failed ("" when it answered)

    @property
    def answering(self) -> bool:
        """Whether its last read answered a list."""
        return self.answered_at is not None and not self.error


def registered_ids(cards: tuple[EngineLoRA, ...] | list[EngineLoRA], export_dir: str | None) -> frozenset[str]:
    """The adapter ids ``cards`` name: an entry of ``export_dir`` by the id its name encodes (whatever the card's name),
    else a card's name that is an adapter id (as the fabric's vLLM resolver and SGLang driver name them)."""
    ids: set[str] = set()
    for card in cards:
        root = card.root.rstrip("/")
        entry = os.path.basename(root) if export_dir and os.path.dirname(root) == export_dir else ""
        for candidate in (adapter_id_of(entry) if entry and not entry.startswith("%") else "", card.name):
            if candidate:
                try:
                    ids.add(validate_adapter_id(candidate))
                    break
                except InvalidArgument:
                    continue
    return frozenset(ids)


class EngineViews:
    """Every engine's registrations; read on I/O threads (``refresh``, ``read``), asked by eviction and listings."""

    def __init__(
        self, urls: tuple[str, ...], export_dir: str | None, read: Callable[[str, float], EngineList] = read_models, driven: tuple[str, ...] = ()
    ) -> None:
        """``urls``: engines watched (their registrations hold adapters). ``driven``: engines a drive reads (shown, holding nothing)."""
        self._states = {url: EngineState(url, engine_label(url), driven=url in driven) for url in dict.fromkeys((*urls, *driven))}
        #: the node's export directory, absolute: only with one can an engine read this node's files, and eviction must ask
        self.export_dir = os.path.abspath(export_dir) if export_dir else None
        self._read = read
        self._lock = threading.Lock()  # guards _states' replacement only: never held through a read
        self._log = StateLog(log)

    @property
    def engines(self) -> list[EngineState]:
        """Every engine's state, as last read."""
        with self._lock:
            return list(self._states.values())

    def refresh(self) -> None:
        """Read every watched engine now (a failed read keeps what it answered last, until STALE_S). Driven ones are read by their drive."""
        for engine in self.engines:
            if not engine.driven:
                self.read(engine.url)

    def read(self, url: str) -> EngineState:
        """Read the engine at ``url`` now; its state after the read (never raises for what the engine answers)."""
        engine = self.state(url)
        try:
            listed = self._read(url, READ_TIMEOUT_S)
        except FabricError as exc:
            return self._failed(engine, str(exc))
        ids = registered_ids(listed.adapters, self.export_dir)
        fresh = dataclasses.replace(engine, adapters=listed.adapters, ids=ids, cut=listed.cut, answered_at=time.monotonic(), error="")
        self._put(fresh)
        metrics.ENGINE_READS.labels(engine.label, "cut" if listed.cut else "ok").inc()
        metrics.ENGINE_ADAPTERS.labels(engine.label).set(len(ids))
        if listed.cut:
            self._log.note(engine.label, f"cut {listed.cut}", "engine's model list cut: every exported adapter is held from eviction until it "
                           "lists them whole", logging.WARNING, engine=engine.label, why=listed.cut, adapters_read=len(listed.adapters))
        else:
            self._log.note(engine.label, f"ok {len(ids)} {hash(ids)}", "engine registrations", engine=engine.label, adapters=len(ids))
        return fresh

    def _failed(self, engine: EngineState, error: str) -> EngineState:
        failed = dataclasses.replace(engine, error=error)
        self._put(failed)
        metrics.ENGINE_READS.labels(engine.label, "failed").inc()
        if engine.driven:
            held = "adapters are loaded once it does"
        elif engine.answered_at is None:
            held = "it never answered: every exported adapter is held from eviction until it does"
        else:
            held = f"its registrations are kept as last read (for at most {STALE_S:g}s, then every exported adapter is held)"
        self._log.note(engine.label, f"failed {error}", f"{'SGLang' if engine.driven else 'engine'} not answering: {held}", logging.WARNING,
                       engine=engine.label, error=error)
        return failed

    def state(self, url: str) -> EngineState:
        with self._lock:
            return self._states[url]

    def _put(self, engine: EngineState) -> None:
        with self._lock:
            self._states[engine.url] = engine

    def engines_of(self, adapter_id: str) -> list[str]:
        """The labels (host:port) of the engines that registered ``adapter_id``, as last read; an engine whose last read
        failed is marked ``NOT_ANSWERING`` (it still holds what it listed, but a listing should not read as if it were up)."""
        return [e.label + (NOT_ANSWERING if e.error else "") for e in self.engines if adapter_id in e.ids]

    def hold(self, ids: list[str]) -> str:
        """What holds one of ``ids`` against eviction: ENGINE, ENGINE_UNKNOWN, ENGINE_CUT, or "" (nothing)."""
        if self.export_dir is None:
            return ""
        now = time.monotonic()
        for engine in self.engines:
            if engine.driven:
                continue  # driven (node.engine_drive): unloaded before its directory goes
            if engine.answered_at is None or now - engine.answered_at > STALE_S:
                return ENGINE_UNKNOWN.format(engine.label)  # it may read any exported directory
            if engine.cut:
                return ENGINE_CUT.format(engine.label, engine.cut)
            if any(i in engine.ids for i in ids):
                return ENGINE.format(engine.label)
        return ""

    async def watch(self, io: Callable[..., Awaitable[Any]]) -> None:
        """Read every watched engine now and every POLL_S (on the node's I/O threads) until cancelled; nothing ends it early."""
        while True:
            await guarded(io, self.refresh, self._log, "engine watch")
            await asyncio.sleep(POLL_S)


async def guarded(io: Callable[..., Awaitable[Any]], job: Callable[[], object], states: StateLog, what: str) -> None:
    """Run ``job`` on an I/O thread; a failure no check foresaw is logged once per kind (its traceback at debug) and the loop goes on."""
    try:
        await io(job)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever an engine's reply holds, the task that reads it keeps running)
        if states.note(what, f"{type(exc).__name__}: {exc}", f"{what} round failed; the next round tries again", logging.ERROR, error=type(exc).__name__):
            log.debug("%s round failed", what, exc_info=True)
    else:
        states.forget(what)
