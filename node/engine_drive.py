"""The driven SGLang (--sglang-url): the node loads into it what its export directory holds, and unloads what it no longer does.

SGLang loads a LoRA only when asked (``adapter_fabric.integrations.sglang``). Every --sglang-sync-interval and
right after the export directory changed (a stage, pull, unstage, eviction or quarantine), ``SGLangDrive``
reads what SGLang lists (through the node's one engine view, ``node.engines``), plans (``sglang.plan``) and
loads each exported adapter under its export name (``team-a%2Fsupport-v3``: the name the directory uses, which
``node.engines.registered_ids`` maps back to the id), and unloads what SGLang loaded from the export directory
that the node no longer holds. What SGLang loaded from elsewhere is left alone. Nothing is remembered across
restarts: a restarted SGLang lists none and gets every adapter again; a restarted node plans from what SGLang lists.

Eviction (``node.eviction``) asks ``release`` to unload its victims first, inside ``paused``: from ``release``
until the block ends (the victims' directories gone) no load of those adapters starts (invariant 14). No lock
is held through a network call: a round's load marks its adapter as loading, and an eviction neither waits for
it nor unloads under it, it holds that adapter (``ENGINE_LOADING``) and chooses others. A victim SGLang would
not unload, or an SGLang not answering, holds the adapter, and the refusal names the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from adapter_fabric.errors import FabricError, InvalidArgument, PeerUnavailable
from adapter_fabric.integrations.sglang import SGLangClient, failure, plan
from adapter_fabric.node.engines import EngineViews, guarded
from adapter_fabric.observability import metrics
from adapter_fabric.observability.logs import StateLog, event
from adapter_fabric.store.eviction import ENGINE_CUT, ENGINE_LOADING, ENGINE_NOT_UNLOADED, ENGINE_UNKNOWN
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

    def __init__(self, client: SGLangClient, views: EngineViews, export_dir: str, interval: float) -> None:
        """``views``: the node's engine view, which lists ``client.url`` as driven (it reads SGLang's list for the drive)."""
        self.client = client
        self.views = views
        self.export_dir = os.path.abspath(export_dir)
        self.interval = interval
        self._round = threading.Lock()  # one round at a time; held through its calls, and never taken by an eviction
        # Guards the four below; never held through a network call (an eviction must not wait behind a slow load).
        self._lock = threading.Lock()
        self._loading: set[str] = set()  # export names a round is loading right now
        self._blocked: Counter[str] = Counter()  # export names an eviction released: no load until its block ends
        self._versions: dict[str, Version] = {}  # export name -> its weights' file as loaded (a re-stage links another)
        self._scope = threading.local()  # the export names an eviction on this thread released (``paused``)
        self._log = StateLog(log, MAX_REFUSALS_KEPT)  # refusals per adapter, calls failing mid-round, conflicts: once each
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
        """Bring SGLang in step now (on an I/O thread); failures are logged and counted, never raised. A round already
        running makes this one a no-op (the drive's loop runs another after it)."""
        if not self._round.acquire(blocking=False):
            return
        try:
            self._reconcile()
        finally:
            self._round.release()

    def _reconcile(self) -> None:
        held = self.held()
        engine = self.views.read(self.client.url)  # logs its own failures, once per change
        if not engine.answering:
            return
        with self._lock:
            changed = frozenset(n for n, (_, version) in held.items() if self._versions.get(n, version) != version)
        todo = plan({n: p for n, (p, _) in held.items()}, list(engine.adapters), self.export_dir, changed)
        if todo.conflicts:
            self._log.note("conflicts", repr(todo.conflicts[:3]) + str(len(todo.conflicts)),
                           "SGLang already uses these names for adapters loaded from elsewhere: left alone", logging.WARNING,
                           engine=self.client.label, adapters=len(todo.conflicts), first=todo.conflicts[0])
        try:
            for name in todo.unloads:
                try:
                    self._unload(name)
                except InvalidArgument:
                    continue  # refused (logged): asked again next round
            for name, path in todo.loads[:MAX_LOADS_PER_ROUND]:
                if self._start_load(name, path, held):
                    try:
                        self._load(name, path, held[name][1])
                    finally:
                        with self._lock:
                            self._loading.discard(name)
        except PeerUnavailable as exc:  # it stopped answering mid-round: the next round starts over
            self._log.note("calls", str(exc), "SGLang not answering: adapters are loaded once it does", logging.WARNING,
                           engine=self.client.label, error=failure(exc))
        else:
            if self._log.state("calls"):
                self._log.note("calls", "", "SGLang answering again", engine=self.client.label)
        with self._lock:
            self._versions = {n: v for n, v in self._versions.items() if n in held}
        self._log.prune(lambda key: not isinstance(key, tuple) or key[1] in held)

    def _start_load(self, name: str, path: str, held: dict[str, tuple[str, Version]]) -> bool:
        """Mark ``name`` as loading, unless an eviction released it or it left the export directory meanwhile."""
        with self._lock:
            if self._blocked[name] or name not in held or not os.path.isdir(path):  # a Counter's miss inserts nothing
                return False
            self._loading.add(name)
            return True

    def _load(self, name: str, path: str, version: Version) -> None:
        try:
            new = self.client.load(name, path)
        except InvalidArgument as exc:
            metrics.ENGINE_LOADS.labels("failed").inc()
            self._log.note(("refused", name), str(exc), "SGLang refused to load an adapter", logging.WARNING,
                           engine=self.client.label, adapter=name, error=failure(exc))
            return
        except PeerUnavailable:
            metrics.ENGINE_LOADS.labels("failed").inc()
            raise
        with self._lock:
            self._versions[name] = version
        self._log.forget(("refused", name))
        metrics.ENGINE_LOADS.labels("ok" if new else "already").inc()
        event(log, "loaded an adapter into SGLang", engine=self.client.label, adapter=name, path=path)

    def _unload(self, name: str) -> None:
        try:
            had = self.client.unload(name)
        except FabricError as exc:
            metrics.ENGINE_UNLOADS.labels("failed").inc()
            event(log, "SGLang did not unload an adapter", logging.WARNING, engine=self.client.label, adapter=name, error=failure(exc))
            raise
        with self._lock:
            self._versions.pop(name, None)
        metrics.ENGINE_UNLOADS.labels("ok" if had else "already").inc()
        event(log, "unloaded an adapter from SGLang", engine=self.client.label, adapter=name)

    # ------------------------------------------------------------ eviction

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No load of an adapter ``release`` unloaded inside the block starts until the block ends (its directory gone).

        Holds no lock: rounds go on meanwhile, loading other adapters.
        """
        released: list[str] = []
        self._scope.released = released
        try:
            yield
        finally:
            self._scope.released = None
            with self._lock:
                for name in released:
                    self._blocked[name] -= 1
                    if self._blocked[name] <= 0:
                        del self._blocked[name]

    def release(self, ids: list[str]) -> dict[str, str]:
        """Unload ``ids`` (adapter ids about to be evicted) from SGLang; id -> what holds it, for each it would not unload.

        Call inside ``paused``. An adapter a round is loading right now is held (``ENGINE_LOADING``), not waited for;
        SGLang not answering, or listing too much to read whole, holds every id still exported (what it loaded is unknown).
        """
        names = {export_name(i): i for i in ids}
        released = getattr(self._scope, "released", None)
        with self._lock:
            loading = {n for n in names if n in self._loading}
            for name in names:
                if name not in loading and released is not None:
                    self._blocked[name] += 1
                    released.append(name)
        refused = {names[n]: ENGINE_LOADING.format(self.client.label) for n in loading}
        engine = self.views.read(self.client.url)
        if not engine.answering or engine.cut:
            held = self.held()
            why = ENGINE_CUT.format(self.client.label, engine.cut) if engine.answering else ENGINE_UNKNOWN.format(self.client.label)
            return refused | {i: why for n, i in names.items() if n in held and n not in loading}
        mine = {os.path.join(self.export_dir, n): n for n in names if n not in loading}
        for card in engine.adapters:
            exported = mine.get(card.root.rstrip("/"))
            if exported is None:
                continue
            try:
                self._unload(card.name)
            except FabricError:
                refused[names[exported]] = ENGINE_NOT_UNLOADED.format(self.client.label)
        return refused

    # ------------------------------------------------------------ the loop

    def poke(self) -> None:
        """Reconcile soon (the export directory changed); safe from any thread."""
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass  # the loop closed: the node is stopping

    async def watch(self, io: Callable[..., Awaitable[Any]]) -> None:
        """Reconcile now, after each poke and every ``interval`` (on the node's I/O threads) until cancelled; nothing ends it early."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._wake.clear()
            await guarded(io, self.reconcile, self._log, "SGLang drive")
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
