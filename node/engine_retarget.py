"""Engines never mix versions: when an id moves to a new digest, the vLLM engines beside the node drop the old one.

vLLM keeps a LoRA by name once resolved and never asks a resolver again while it holds the name, so the node
itself notices a move for it: every ``INTERVAL_S`` it reads each ``--engine-url``'s ``GET /v1/models``,
revalidates the origin ids the engines hold once their record is older than ``--origin-ttl`` (a move is then
seen even though no request reaches the node), and unloads (``integrations.vllm_admin.unload_lora``):

- right after a move (``on_move``), every card naming the id whose path is not the new digest's version entry;
- in each round, every card loaded from a version entry (``<id>#<digest prefix>``) of a digest its id has left
  (an engine that did not answer at the move, or that registered the old path again).

The next request for the name goes through vLLM's resolvers again: the fabric's answers the new digest from
a path named by it, under a new LoRA int id, so vLLM's prefix cache (keyed by name and path) reuses no block
of the old weights. The bound: an engine stops serving the old weights within ``--origin-ttl`` plus
``INTERVAL_S`` plus one origin fetch of the change (docs/ARCHITECTURE.md, invariant 19); requests already
running when it unloads finish on the weights they started with. A driven SGLang (``node.engine_drive``) needs
none of this: its export entry's weights change inode on a move, and the drive unloads and loads it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from adapter_fabric.errors import FabricError, InvalidArgument
from adapter_fabric.integrations.engine_models import EngineList, EngineLoRA, engine_label, read_models
from adapter_fabric.integrations.vllm_admin import unload_lora
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.store.export import VERSION_MARK, adapter_id_of, version_name
from adapter_fabric.store.ids import validate_adapter_id

log = logging.getLogger("fabric.node")

#: seconds between two rounds (reads of every engine; revalidations of what they hold)
INTERVAL_S = 10.0
#: bound on one /v1/models read
READ_TIMEOUT_S = 5.0
#: origin ids one round revalidates at most (the rest wait for the next round)
MAX_REVALIDATIONS_PER_ROUND = 64


class EngineRetarget:
    """Keeps the vLLM engines at ``urls`` off digests their ids have left (see the module docstring)."""

    def __init__(
        self, urls: tuple[str, ...], export_dir: str | None, current: Callable[[str], str | None], stale: Callable[[str, str], bool],
        interval: float = INTERVAL_S, read: Callable[[str, float], EngineList] = read_models, unload: Callable[[str, str], bool] = unload_lora,
    ) -> None:  # fmt: skip
        """``current(id)``: the digest the id names here now (None: not staged); ``stale(id, digest)``: whether that
        digest came from an origin and is older than --origin-ttl (it should be revalidated)."""
        self.urls = urls
        self.export_dir = os.path.abspath(export_dir) if export_dir else None
        self.current = current
        self.stale = stale
        self.interval = interval
        self._read = read
        self._unload = unload
        self._refused: dict[str, str] = {}  # engine label -> why it refused last (logged once)

    def card_id(self, card: EngineLoRA) -> tuple[str, str]:
        """(the adapter id a card stands for, the digest prefix of the version entry it was loaded from, or "")."""
        root = card.root.rstrip("/")
        if self.export_dir and os.path.dirname(root) == self.export_dir:
            name, mark, prefix = os.path.basename(root).partition(VERSION_MARK)
            candidate = adapter_id_of(name)
        else:
            candidate, mark, prefix = card.name, "", ""
        try:
            return validate_adapter_id(candidate), prefix if mark else ""
        except InvalidArgument:
            return "", ""

    # ------------------------------------------------------------ after a move (an I/O thread)

    def on_move(self, adapter_id: str, old: str, new: str) -> None:
        """Unload ``adapter_id`` from every engine that holds it from anywhere but ``new``'s version entry."""
        keep = os.path.join(self.export_dir, version_name(adapter_id, new)) if self.export_dir else ""
        for url in self.urls:
            cards = self._cards(url)
            for card in cards or ():
                if self.card_id(card)[0] == adapter_id and card.root.rstrip("/") != keep:
                    self._drop(url, card.name, adapter_id, old, new)

    # ------------------------------------------------------------ a round (an I/O thread)

    def sweep(self) -> list[str]:
        """Unload cards of digests their ids have left; the origin ids engines hold that are due a revalidation."""
        due: list[str] = []
        for url in self.urls:
            for card in self._cards(url) or ():
                adapter_id, prefix = self.card_id(card)
                if not adapter_id:
                    continue
                digest = self.current(adapter_id)
                if digest is None:
                    continue  # unstaged or evicted: eviction and the engine view hold what an engine names
                if prefix and not digest.startswith(prefix):
                    self._drop(url, card.name, adapter_id, prefix, digest)
                elif self.stale(adapter_id, digest) and adapter_id not in due:
                    due.append(adapter_id)
        return due[:MAX_REVALIDATIONS_PER_ROUND]

    def _cards(self, url: str) -> tuple[EngineLoRA, ...] | None:
        try:
            return self._read(url, READ_TIMEOUT_S).adapters  # a list cut short: what it holds is still acted on
        except FabricError as exc:
            log.info("engine %s not read for moved ids: %s", engine_label(url), str(exc)[:200])
            return None

    def _drop(self, url: str, name: str, adapter_id: str, old: str, new: str) -> None:
        label = engine_label(url)
        try:
            had = self._unload(url, name)
        except FabricError as exc:
            metrics.ENGINE_MOVED_UNLOADS.labels(label, "failed").inc()
            if self._refused.get(label) != str(exc):
                event(log, "engine did not unload an adapter whose id moved: it serves the old digest until it does", logging.WARNING,
                      engine=label, adapter=adapter_id, old=old[:12], error=str(exc)[:300])  # fmt: skip
                self._refused[label] = str(exc)
            return
        self._refused.pop(label, None)
        metrics.ENGINE_MOVED_UNLOADS.labels(label, "ok" if had else "already").inc()
        event(log, "unloaded a moved adapter from an engine: its next request resolves the new digest", engine=label, adapter=adapter_id,
              old=old[:12], new=new[:12])  # fmt: skip

    # ------------------------------------------------------------ the loop

    async def watch(self, io: Callable[..., Awaitable[Any]], revalidate: Callable[[str], Awaitable[Any]]) -> None:
        """A round now and every ``interval`` until cancelled; ``revalidate(id)`` resolves a due id (a move calls on_move)."""
        while True:
            started = time.monotonic()
            try:
                due = await io(self.sweep)
            except (OSError, FabricError) as exc:  # the store unreadable now (gone, failing disk): the next round tries again
                log.warning("engine retarget round failed: %s", str(exc)[:200])
                due = []
            for adapter_id in due:
                try:
                    await revalidate(adapter_id)
                except (OSError, FabricError) as exc:
                    log.info("revalidating %s for its engines: %s", adapter_id, str(exc)[:200])
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))



def retarget_for(settings, store, origins, export_dir: str | None) -> EngineRetarget | None:
    """The node's EngineRetarget when it has origins and --engine-url engines (ids move only from an origin), wired to its moves."""
    if origins is None or not settings.origin or not settings.engine_url:
        return None

    def current(adapter_id: str) -> str | None:
        return store.digest_of(adapter_id)

    retarget = EngineRetarget(settings.engine_url, export_dir, current, origins.stale, interval=max(1.0, min(INTERVAL_S, settings.origin_ttl)))
    origins.on_move.append(lambda adapter_id, old, new: origins.context.io(retarget.on_move, adapter_id, old, new))
    return retarget
