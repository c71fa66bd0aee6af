"""What the cache keeps about adapters beside the refs: when each was last used, and which an operator kept.

Recency is the mtime of the adapter's ref file (touched on promote, pull and
serve): it survives a restart and costs no scan until an eviction reads it.
Kept ids are empty marker files under ``kept/`` (named as refs are).
"""

from __future__ import annotations

import os

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.store.files import encode_id
from adapter_fabric.store.layout import StoreLayout


class Recency:
    """When each adapter id was last used: its ref file's mtime."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout

    def touch(self, adapter_id: str) -> None:
        """Mark ``adapter_id`` used now (nothing when it is not staged)."""
        try:
            os.utime(self.layout.ref(adapter_id))
        except FileNotFoundError:
            pass

    def last_used(self, adapter_id: str) -> float:
        """Seconds since the epoch of its last use; 0.0 when it is not staged."""
        try:
            return os.stat(self.layout.ref(adapter_id)).st_mtime
        except FileNotFoundError:
            return 0.0


class KeptIds:
    """Adapter ids an operator kept: an evicting store never drops them (they survive restarts)."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self.root = layout.root / "kept"
        self.root.mkdir(exist_ok=True)

    def set(self, adapter_id: str, kept: bool) -> None:
        """Keep (or stop keeping) a staged id; ``AdapterNotFound`` when keeping one that is not staged."""
        marker = self.root / encode_id(adapter_id)
        if not kept:
            marker.unlink(missing_ok=True)
            return
        if not self.layout.ref(adapter_id).exists():
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store: only a staged adapter can be kept")
        marker.touch()

    def __contains__(self, adapter_id: str) -> bool:
        return (self.root / encode_id(adapter_id)).exists()

    def count(self) -> int:
        """How many ids are kept."""
        return sum(1 for _ in os.scandir(self.root))
