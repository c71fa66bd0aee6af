"""The manifests a store read lately, bounded: a listing of 100,000 ids must not keep 100,000 in memory.

Manifests are immutable once written (named by their digest), so an entry is
valid while its file exists; the least recently used go first past the bound.
Measured without the bound: a full paged listing of 100,000 adapters raised a
node's memory from 260 to 1,054 MiB, held until it stopped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from adapter_fabric.store.manifest import Manifest

#: manifests kept (about 8 KiB each: ~32 MiB): more than a listing page (5,000 at most) reads at once
MAX_CACHED_MANIFESTS = 4096


class ManifestCache:
    """Digest -> manifest, the ``capacity`` most recently used; safe from the node's I/O threads."""

    def __init__(self, capacity: int = MAX_CACHED_MANIFESTS) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, Manifest] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> Manifest | None:
        with self._lock:
            manifest = self._entries.get(digest)
            if manifest is not None:
                self._entries.move_to_end(digest)
            return manifest

    def put(self, manifest: Manifest) -> None:
        with self._lock:
            self._entries[manifest.digest] = manifest
            self._entries.move_to_end(manifest.digest)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def drop(self, digest: str) -> None:
        with self._lock:
            self._entries.pop(digest, None)

    def __len__(self) -> int:
        return len(self._entries)
