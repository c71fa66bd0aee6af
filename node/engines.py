"""The engines' view: which adapters the inference engines beside this node have registered (--engine-url).

vLLM reads a LoRA's directory again whenever its own CPU cache dropped the weights, so an exported
directory must stay while the engine names it. Each engine's ``GET /v1/models``
(``adapter_fabric.integrations.engine_models``) is read every ``POLL_S`` and right before an eviction; a
card whose ``root`` is an entry of the export directory (its name encodes the id) or whose name is an
adapter id (an engine mounting the export volume elsewhere: the fabric's resolver and driver name each
adapter by its id) marks that id registered. Eviction holds registered adapters (``ENGINE``), and while an
engine has not answered for ``STALE_S`` every exported adapter (``ENGINE_UNKNOWN``): what it may still
read is unknown, so the store refuses a commit, naming the engine, rather than pull a directory out from
under it. ``fabric ls`` and the metrics show each adapter's engines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from adapter_fabric.errors import FabricError, InvalidArgument
from adapter_fabric.integrations.engine_models import EngineLoRA, engine_label, read_models
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.store.eviction import ENGINE, ENGINE_UNKNOWN
from adapter_fabric.store.export import adapter_id_of
from adapter_fabric.store.ids import validate_adapter_id

log = logging.getLogger("fabric.node")

#: seconds between reads of each engine's /v1/models
POLL_S = 10.0
#: an engine unanswered this long has registrations unknown: exported adapters are held until it answers
STALE_S = 300.0
#: what a listing adds to an engine whose last read failed (fabric ls: "engines: 127.0.0.1:8000 (not answering)")
NOT_ANSWERING = " (not answering: held as last read)"
#: bound on one read (connect and reply)
READ_TIMEOUT_S = 5.0


@dataclass
class EngineState:
    """What one engine answered last, and when."""

    url: str
    label: str
    ids: frozenset[str] = frozenset()
    answered_at: float | None = None  # monotonic; None until the first answer
    error: str = ""  # why the last read failed ("" when it answered)


def registered_ids(cards: list[EngineLoRA], export_dir: str | None) -> frozenset[str]:
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
    """Every watched engine's registrations; read on a thread (``refresh``), asked by eviction and listings."""

    def __init__(
        self, urls: tuple[str, ...], export_dir: str | None, read: Callable[[str, float], list[EngineLoRA]] = read_models, shown: tuple[str, ...] = ()
    ) -> None:
        """``shown``: engines listed and shown but holding nothing (a driven SGLang: the node unloads before it evicts)."""
        self.engines = [EngineState(url, engine_label(url)) for url in dict.fromkeys((*urls, *shown))]
        self._holding = {engine_label(url) for url in urls if url not in shown}
        #: the node's export directory, absolute: only with one can an engine read this node's files, and eviction must ask
        self.export_dir = os.path.abspath(export_dir) if export_dir else None
        self._read = read
        self._lock = threading.Lock()  # refreshes run on I/O threads, eviction on another

    def refresh(self) -> None:
        """Read every engine now (a failed read keeps what it answered last, until STALE_S)."""
        with self._lock:
            for engine in self.engines:
                self._read_one(engine)

    def _read_one(self, engine: EngineState) -> None:
        try:
            ids = registered_ids(self._read(engine.url, READ_TIMEOUT_S), self.export_dir)
        except FabricError as exc:
            if str(exc) != engine.error:  # one line per change of state, not per poll
                held = (
                    "it never answered: every exported adapter is held from eviction until it does"
                    if engine.answered_at is None
                    else f"its registrations are kept as last read (for at most {STALE_S:g}s, then every exported adapter is held)"
                )
                event(log, f"engine not answering: {held}", logging.WARNING, engine=engine.label, error=str(exc))
            engine.error = str(exc)
            metrics.ENGINE_READS.labels(engine.label, "failed").inc()
            return
        if engine.error or engine.answered_at is None or ids != engine.ids:
            event(log, "engine registrations", engine=engine.label, adapters=len(ids))
        engine.ids, engine.answered_at, engine.error = ids, time.monotonic(), ""
        metrics.ENGINE_READS.labels(engine.label, "ok").inc()
        metrics.ENGINE_ADAPTERS.labels(engine.label).set(len(ids))

    def engines_of(self, adapter_id: str) -> list[str]:
        """The labels (host:port) of the engines that registered ``adapter_id``, as last read; an engine whose last read
        failed is marked ``NOT_ANSWERING`` (it still holds what it listed, but a listing should not read as if it were up)."""
        return [e.label + (NOT_ANSWERING if e.error else "") for e in self.engines if adapter_id in e.ids]

    def hold(self, ids: list[str]) -> str:
        """What holds one of ``ids`` against eviction: ENGINE, ENGINE_UNKNOWN, or "" (nothing)."""
        if self.export_dir is None:
            return ""
        now = time.monotonic()
        for engine in self.engines:
            if engine.label not in self._holding:
                continue  # driven (node.engine_drive): unloaded before its directory goes
            if engine.answered_at is None or now - engine.answered_at > STALE_S:
                return ENGINE_UNKNOWN.format(engine.label)  # it may read any exported directory
            if any(i in engine.ids for i in ids):
                return ENGINE.format(engine.label)
        return ""

    async def watch(self, io: Callable[..., "asyncio.Future"]) -> None:
        """Read every engine now and every POLL_S (on the node's I/O threads) until cancelled."""
        while True:
            await io(self.refresh)
            await asyncio.sleep(POLL_S)
