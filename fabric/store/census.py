"""The census of a store (its sound and its damaged ids), kept between calls: a StoreStatus at 100,000 ids reads no file per id.

Taking a census reads every ref and checks each digest's manifest and blobs
(~3 stats an id: seconds at 100,000). So one is taken whole once, then kept
in step with this process's own changes, as the live index is for collection
(``adapter_fabric.store.live_index``): the committer tells it, under the
store's lock, when it starts changing the store (``changing``), each ref it
set or removed, and when it is done (``changed``). The ids themselves are the
sorted index the listing keeps (``adapter_fabric.store.ref_index``); the census
keeps only the damaged ones and why.

Anything else that changes what a census sees moves a directory's mtime: a
ref written or removed (``refs/``), a manifest (``manifests/``), a blob
(its ``blobs/blake3/<xx>/`` directory), a quarantine (``quarantine/``), or
another process's commit (the ref generation). The census is trusted while
its stamp of all of those is the one taken after its own last change; any
other difference takes it whole again. A change in the same timestamp tick as
this process's own can hide behind it (``adapter_fabric.store.stamps``): a
stamp taken within that tick is trusted only until the tick is past, then the
census is taken whole once more. Nothing is ever lost by a stale census: it
is a report (the listing, every read and the scrub check their own bytes).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from adapter_fabric.store.catalog import Catalog, is_digest
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.stamps import RACY_NS

#: one damaged id: (its digest, "" when its entry holds none; why it cannot be used)
Damage = tuple[str, str]


class Census:
    """Sound and damaged ids of one store, taken whole when something other than this process's commits changed it."""

    def __init__(self, layout: StoreLayout, catalog: Catalog, generation: Callable[[], int]) -> None:
        self.layout = layout
        self.catalog = catalog
        self._generation = generation
        self._damaged: dict[str, Damage] | None = None  # None: take it whole at the next read
        self._stamp: tuple[int, ...] = ()
        self._settled = False  # the stamp was read after its newest mtime's tick had passed
        self._touched: set[str] | None = None  # while a census is taken: ids the committer changed meanwhile
        self._lock = threading.Lock()  # the state above; held briefly (the committer waits on it under the store's lock)
        self._taking = threading.Lock()  # one whole census at a time

    # ------------------------------------------------------------ reading

    def read(self) -> tuple[list[str], list[tuple[str, str, str]]]:
        """The sound ids (sorted) and the damaged ones as (id, digest, problem), sorted by id."""
        with self._taking:
            with self._lock:
                if not self._current():
                    self._touched = set()
                    stamp, started = self._take_stamp(), time.time_ns()
                    current = False
                else:
                    current = True
            if not current:
                damaged = self._take()  # outside the lock: commits go on meanwhile, and are re-read below
                with self._lock:
                    touched, self._touched = self._touched or set(), None
                    for adapter_id in touched:
                        self._recheck(damaged, adapter_id)
                    self._damaged = damaged
                    self._stamp = self._take_stamp() if touched else stamp
                    self._settled = not touched and started - max(stamp[1:]) >= RACY_NS
            with self._lock:
                found = dict(self._damaged or {})
        ids = self.catalog.index.page("", sys.maxsize)
        sound = [i for i in ids if i not in found]
        return sound, [(i, *found[i]) for i in sorted(found)]

    def take(self, refs: dict[str, str], whole: set[str] | None) -> None:
        """Take the census whole from ``refs``, every ref of the store read a moment ago under the store's lock, still held
        (the start-up collection's): no ref is read again, and no commit runs meanwhile. ``whole``: the digests found whole
        then (their manifest read, every blob listed): not checked again."""
        with self._taking, self._lock:
            stamp, started = self._take_stamp(), time.time_ns()
            self._damaged = self._damage_of(refs, whole or set())
            self._stamp, self._settled = stamp, started - max(stamp[1:]) >= RACY_NS

    def _current(self) -> bool:
        if self._damaged is None or self._take_stamp() != self._stamp:
            return False
        return self._settled or time.time_ns() - max(self._stamp[1:]) < RACY_NS  # our own change's tick: trusted while recent

    def _take(self) -> dict[str, Damage]:
        return self._damage_of(self.catalog.refs())

    def _damage_of(self, refs: dict[str, str], whole: set[str] | frozenset[str] = frozenset()) -> dict[str, Damage]:
        damaged: dict[str, Damage] = {}
        for adapter_id, digest in refs.items():
            problem = "" if digest in whole else self.catalog.problem(digest)
            if problem:
                damaged[adapter_id] = (digest if is_digest(digest) else "", problem)
        return damaged

    def _recheck(self, damaged: dict[str, Damage], adapter_id: str) -> None:
        digest = self.catalog.read_ref(adapter_id)
        problem = self.catalog.problem(digest) if digest is not None else ""
        if problem and digest is not None:
            damaged[adapter_id] = (digest if is_digest(digest) else "", problem)
        else:
            damaged.pop(adapter_id, None)

    def _take_stamp(self) -> tuple[int, ...]:
        layout = self.layout
        try:
            mtimes = [os.stat(d).st_mtime_ns for d in (layout.refs, layout.manifests, layout.quarantine, layout.blobs)]
            mtimes += [entry.stat().st_mtime_ns for entry in os.scandir(layout.blobs)]  # a blob gone from its fan-out directory
        except FileNotFoundError:
            raise self.catalog.missing_store() from None
        return (self._generation(), *mtimes)

    # ------------------------------------------------------------ this process's changes (under the store's lock)

    def changing(self) -> None:
        """The committer starts changing the store: a difference from the stamp now is someone else's."""
        with self._lock:
            if self._damaged is not None and self._take_stamp() != self._stamp:
                self._damaged = None

    def ref_set(self, adapter_id: str, digest: str) -> None:
        """``adapter_id`` now names ``digest``, committed whole (it may still be damaged: a blob quarantined meanwhile)."""
        with self._lock:
            if self._touched is not None:
                self._touched.add(adapter_id)
            if self._damaged is not None:
                problem = self.catalog.problem(digest)
                if problem:
                    self._damaged[adapter_id] = (digest, problem)
                else:
                    self._damaged.pop(adapter_id, None)

    def ref_removed(self, adapter_id: str) -> None:
        with self._lock:
            if self._touched is not None:
                self._touched.add(adapter_id)
            if self._damaged is not None:
                self._damaged.pop(adapter_id, None)

    def changed(self, whole: bool = True) -> None:
        """The committer is done (``whole`` False: it failed part way, so the next read takes the census whole)."""
        with self._lock:
            if self._damaged is None:
                return
            if not whole:
                self._damaged = None
                return
            self._stamp, self._settled = self._take_stamp(), False
