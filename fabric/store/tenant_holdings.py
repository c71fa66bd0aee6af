"""What the committed ids under each quota's prefix refer to, kept between writers: a reserve at 100,000 ids reads no ref.

A tenant's usage is its ids and the distinct blobs they name (``adapter_fabric.store.tenants``), and every writer of
an id under a quota asks for it before its first byte. Read whole, it lists every ref name and reads each of the
tenant's refs and manifests: ~0.1 s at 100,000 ids, and a manifest read per id of the tenant on top (a tenant of
10,000 ids: seconds, per writer). So it is read whole once, then kept in step with this process's commits
(``ref_set``/``ref_removed``, told by the committer under the store's lock), as the census is.

It is trusted while the store's live index is (``LiveIndex.current``: no other process changed a ref since this one
last saw them) and was not rebuilt since (its ``epoch``), for the same prefixes; otherwise the next read takes it
whole again. Ids this process's committer changed while it was being taken are read again before it is kept.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from adapter_fabric.errors import FabricError
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.files import decode_id
from adapter_fabric.store.live_index import LiveIndex

#: one id's files: (blob root, size) each
Files = tuple[tuple[str, int], ...]


@dataclass
class Holding:
    """One tenant's committed ids, each with its files, and how many of them name each blob."""

    files_of: dict[str, Files] = field(default_factory=dict)
    users: Counter[str] = field(default_factory=Counter)
    sizes: dict[str, int] = field(default_factory=dict)

    def add(self, adapter_id: str, files: Files) -> None:
        self.remove(adapter_id)
        self.files_of[adapter_id] = files
        for root, size in files:
            self.users[root] += 1
            self.sizes[root] = size

    def remove(self, adapter_id: str) -> None:
        for root, _ in self.files_of.pop(adapter_id, ()):
            self.users[root] -= 1
            if self.users[root] <= 0:
                del self.users[root]
                del self.sizes[root]


class TenantHoldings:
    """Each quota prefix's ``Holding``, taken whole when the live index says another process changed a ref."""

    def __init__(self, catalog: Catalog, live: LiveIndex) -> None:
        self.catalog = catalog
        self.live = live
        self._held: dict[str, Holding] | None = None  # None: take it whole at the next read
        self._epoch = -1  # the live index's epoch when it was taken
        self._touched: set[str] | None = None  # while it is taken: ids the committer changed meanwhile
        self._lock = threading.Lock()  # the state above; held briefly (the committer takes it under the store's lock)
        self._taking = threading.Lock()  # one whole take at a time

    def read(self, prefixes: tuple[str, ...], wanted: Iterable[str]) -> dict[str, tuple[set[str], dict[str, int]]]:
        """The ids and the blobs (root -> size) of each ``wanted`` prefix, kept for all of ``prefixes`` (the quotas in force)."""
        prefixes = tuple(dict.fromkeys(prefixes))
        with self._taking:
            with self._lock:
                if self._held is not None and self._trusted(prefixes):
                    return _copy(self._held, wanted)
                self._touched, epoch, current = set(), self.live.epoch, self.live.current()
            held = self._take(prefixes)  # outside the lock: commits go on, and the ids they change are read again
            with self._lock:
                touched, self._touched = self._touched or set(), None
                for adapter_id in touched:
                    self._put(held, adapter_id, self.catalog.read_ref(adapter_id))
                self._held, self._epoch = (held, epoch) if current else (None, -1)
                return _copy(held, wanted)

    def _trusted(self, prefixes: tuple[str, ...]) -> bool:
        return tuple(self._held or ()) == prefixes and self._epoch == self.live.epoch and self.live.current()

    def _take(self, prefixes: tuple[str, ...]) -> dict[str, Holding]:
        held = {p: Holding() for p in prefixes}
        try:
            names = [entry.name for entry in os.scandir(self.catalog.layout.refs)]
        except FileNotFoundError:
            raise self.catalog.missing_store() from None
        for name in names:
            adapter_id = decode_id(name)
            if covering(adapter_id, held):
                self._put(held, adapter_id, self.catalog.read_ref(adapter_id))
        return held

    def _put(self, held: dict[str, Holding], adapter_id: str, digest: str | None) -> None:
        """``adapter_id`` names ``digest`` now (None: not staged) in every holding whose prefix covers it."""
        mine = [held[p] for p in covering(adapter_id, held)]
        if not mine:
            return
        files: Files = ()
        if digest is not None:
            try:
                manifest = self.catalog.load_manifest(digest)
            except FabricError:
                manifest = None  # damaged: its id counts, its bytes are unknown (store-status names it)
            files = tuple((sys.intern(f.root), f.size) for f in manifest.files) if manifest is not None else ()
        for holding in mine:
            if digest is None:
                holding.remove(adapter_id)
            else:
                holding.add(adapter_id, files)

    # ------------------------------------------------------------ this process's changes (under the store's lock)

    def ref_set(self, adapter_id: str, digest: str) -> None:
        with self._lock:
            if self._touched is not None:
                self._touched.add(adapter_id)
            if self._held is not None:
                self._put(self._held, adapter_id, digest)

    def ref_removed(self, adapter_id: str) -> None:
        with self._lock:
            if self._touched is not None:
                self._touched.add(adapter_id)
            if self._held is not None:
                self._put(self._held, adapter_id, None)


def covering(adapter_id: str, prefixes: Container[str]) -> list[str]:
    """The prefixes (lower-case, each ending in ``/``, as quotas' are) ``adapter_id`` is under, case-blind: one lookup per
    ``/`` in the id, not a test per prefix (a policy may hold 1,000 quotas: 13 s for a whole read at 100,000 ids)."""
    lowered = adapter_id.lower()
    found = []
    at = lowered.find("/")
    while at >= 0:
        if lowered[: at + 1] in prefixes:
            found.append(lowered[: at + 1])
        at = lowered.find("/", at + 1)
    return found


def _copy(held: dict[str, Holding], wanted: Iterable[str]) -> dict[str, tuple[set[str], dict[str, int]]]:
    return {p: (set(held[p].files_of), dict(held[p].sizes)) for p in wanted}
