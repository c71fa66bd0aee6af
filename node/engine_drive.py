"""The driven SGLang (--sglang-url): the node loads into it what its export directory holds, and unloads what it no longer does.

SGLang loads a LoRA only when asked (``adapter_fabric.integrations.sglang``). Every --sglang-sync-interval and
right after the export directory changed (a stage, pull, unstage, eviction or quarantine), ``SGLangDrive``
reads what SGLang lists, plans (``sglang.plan``) and loads each exported adapter under its export name
(``team-a%2Fsupport-v3``: the name the directory uses, which ``node.engines.registered_ids`` maps back to
the id), and unloads what SGLang loaded from the export directory that the node no longer holds. What
SGLang loaded from elsewhere is left alone. Nothing is remembered across restarts: a restarted SGLang lists
none and gets every adapter again; a restarted node plans from what SGLang lists.

Eviction (``node.eviction``) asks ``release`` to unload its victims first, under the drive's lock (no load
runs between that unload and the directory going; invariant 14); a victim SGLang would not unload, or an
SGLang not answering, holds the adapter, and the refusal names the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from adapter_fabric.errors import FabricError, InvalidArgument, PeerUnavailable
from adapter_fabric.integrations.sglang import SGLangClient, failure, plan
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import event
from adapter_fabric.store.eviction import ENGINE_NOT_UNLOADED, ENGINE_UNKNOWN
from adapter_fabric.store.export import VERSION_MARK, adapter_id_of, export_name
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import WEIGHTS_FILE

log = logging.getLogger("fabric.node")

#: loads one round makes at most (each reads an adapter's files): the rest come in the next rounds
MAX_LOADS_PER_ROUND = 64
#: a weights file's identity: (inode, mtime in ns); a re-stage hard-links another blob, written anew
Version = tuple[int, int]
#: refusals remembered (each logged once, not every round)
MAX_REFUSALS_KEPT = 1000


class SGLangDrive:
    """Keeps one SGLang server's LoRA registry in step with the export directory ``export_dir``."""

    def __init__(self, client: SGLangClient, export_dir: str, interval: float) -> None:
        self.client = client
        self.export_dir = os.path.abspath(export_dir)
        self.interval = interval
        self._lock = threading.Lock()  # one reconcile or eviction's release at a time (both run on I/O threads)
        self._versions: dict[str, Version] = {}  # export name -> its weights' file as loaded (a re-stage links another)
        self._refused: dict[str, str] = {}  # export name -> why its load was refused last (logged once)
        self._down = ""  # why SGLang did not answer last ("" when it did): logged once per change
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ what the export directory holds

    def held(self) -> dict[str, tuple[str, Version]]:
        """Export name -> (its absolute path, its weights' Version) of every adapter entry in the export directory."""
        found: dict[str, tuple[str, Version]] = {}
        try:
            entries = list(os.scandir(self.export_dir))
        except OSError:
            return found
        for entry in entries:
            if entry.name.startswith("%") or VERSION_MARK in entry.name:
                continue  # being built or set aside, or a digest's version entry for vLLM (adapter_fabric.store.export)
            try:
                validate_adapter_id(adapter_id_of(entry.name))
                weights = os.stat(os.path.join(entry.path, WEIGHTS_FILE))
            except (InvalidArgument, OSError):
                continue  # an operator's own file, or removed meanwhile
            found[entry.name] = (entry.path, (weights.st_ino, weights.st_mtime_ns))
        return found

    # ------------------------------------------------------------ one round

    def reconcile(self) -> None:
        """Bring SGLang in step now (on an I/O thread); failures are logged and counted, never raised."""
        with self._lock:
            held = self.held()
            try:
                loaded = self.client.loaded()
            except FabricError as exc:
                self._not_answering(exc)
                return
            self._answering()
            changed = frozenset(n for n, (_, version) in held.items() if self._versions.get(n, version) != version)
            todo = plan({n: p for n, (p, _) in held.items()}, loaded, self.export_dir, changed)
            if todo.conflicts:
                event(log, "SGLang already uses these names for adapters loaded from elsewhere: left alone", logging.WARNING,
                      engine=self.client.label, adapters=len(todo.conflicts), first=todo.conflicts[0])
            try:
                for name in todo.unloads:
                    try:
                        self._unload(name)
                    except InvalidArgument:
                        continue  # refused (logged): asked again next round
                for name, path in todo.loads[:MAX_LOADS_PER_ROUND]:
                    if name in held and os.path.isdir(path):  # still exported (an unstage by hand may have come)
                        self._load(name, path, held[name][1])
            except PeerUnavailable as exc:  # it stopped answering mid-round: the next round starts over
                self._not_answering(exc)
            self._versions = {n: v for n, v in self._versions.items() if n in held}
            self._refused = {n: r for n, r in self._refused.items() if n in held}

    def _load(self, name: str, path: str, version: Version) -> None:
        try:
            new = self.client.load(name, path)
        except InvalidArgument as exc:
            metrics.ENGINE_LOADS.labels("failed").inc()
            if self._refused.get(name) != str(exc) and len(self._refused) < MAX_REFUSALS_KEPT:
                event(log, "SGLang refused to load an adapter", logging.WARNING, engine=self.client.label, adapter=name, error=failure(exc))
                self._refused[name] = str(exc)
            return
        except PeerUnavailable:
            metrics.ENGINE_LOADS.labels("failed").inc()
            raise
        self._versions[name] = version
        self._refused.pop(name, None)
        metrics.ENGINE_LOADS.labels("ok" if new else "already").inc()
        event(log, "loaded an adapter into SGLang", engine=self.client.label, adapter=name, path=path)

    def _unload(self, name: str) -> None:
        try:
            had = self.client.unload(name)
        except FabricError as exc:
            metrics.ENGINE_UNLOADS.labels("failed").inc()
            event(log, "SGLang did not unload an adapter", logging.WARNING, engine=self.client.label, adapter=name, error=failure(exc))
            raise
        self._versions.pop(name, None)
        metrics.ENGINE_UNLOADS.labels("ok" if had else "already").inc()
        event(log, "unloaded an adapter from SGLang", engine=self.client.label, adapter=name)

    def _not_answering(self, exc: FabricError) -> None:
        if str(exc) != self._down:  # one line per change of state, not per round
            event(log, "SGLang not answering: adapters are loaded once it does", logging.WARNING, engine=self.client.label, error=failure(exc))
        self._down = str(exc)

    def _answering(self) -> None:
        if self._down:
            event(log, "SGLang answering again", engine=self.client.label)
        self._down = ""

    # ------------------------------------------------------------ eviction

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No reconcile runs while the block does (an eviction: its unloads and its directories' removal)."""
        with self._lock:
            yield

    def release(self, ids: list[str]) -> dict[str, str]:
        """Unload ``ids`` (adapter ids about to be evicted) from SGLang; id -> what holds it, for each it would not unload.

        Call inside ``paused``. SGLang not answering holds every id still exported (what it loaded is unknown).
        """
        names = {export_name(i): i for i in ids}
        try:
            loaded = self.client.loaded()
        except FabricError as exc:
            self._not_answering(exc)
            held = self.held()
            return {i: ENGINE_UNKNOWN.format(self.client.label) for n, i in names.items() if n in held}
        mine = {os.path.join(self.export_dir, n) for n in names}
        refused: dict[str, str] = {}
        for card in loaded:
            path = card.root.rstrip("/")
            if path not in mine:
                continue
            try:
                self._unload(card.name)
            except FabricError:
                refused[names[os.path.basename(path)]] = ENGINE_NOT_UNLOADED.format(self.client.label)
        return refused

    # ------------------------------------------------------------ the loop

    def poke(self) -> None:
        """Reconcile soon (the export directory changed); safe from any thread."""
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass  # the loop closed: the node is stopping

    async def watch(self, io: Callable[..., "asyncio.Future"]) -> None:
        """Reconcile now, after each poke and every ``interval`` (on the node's I/O threads) until cancelled."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._wake.clear()
            await io(self.reconcile)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
