"""Store limits: the size of one adapter, its header, and the bytes the whole store may hold.

The store's rule at its limit is local and quick: a writer that would pass it
is refused (``StoreFull``) before a byte is written, and nothing else happens
here. Making room is the node's business (``adapter_fabric.node.eviction``): it
runs outside every store lock, and a writer refused for room is opened again
once room was made (``opened_with_room``). Kraken's store works the same way:
its cleanup is a job over the store, never a call the store makes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from adapter_fabric.errors import InvalidHeader, LimitExceeded, StoreFull
from adapter_fabric.format.safetensors_index import MAX_HEADER_BYTES
from adapter_fabric.store.dir_sizes import DirSizes, tree_bytes
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.units import describe_size

T = TypeVar("T")

#: makes room for a writer the store refused (``StoreFull``) or raises ``QuotaExceeded`` naming why it cannot; called
#: with no store lock held, it may wait on the network (an eviction's hand-off) within its own bound
MakeRoom = Callable[[StoreFull], None]


def quota_exceeded(needed: int, used: int, limit: int, what: str, why: str = "", *, held: str = "", after: int | None = None) -> StoreFull:
    """The refusal of ``needed`` more bytes in a store holding ``used`` of ``limit``, sizes in store-status's units.

    ``why``: the store's role (a durable node), said after. ``held`` and ``after``: an evicting store that could not make
    room: what holds the rest, each with what frees it (``adapter_fabric.store.eviction.refusal``), and what dropping
    every cold adapter would still leave.
    """
    text = (
        f"{what} needs {describe_size(needed)}, and the store holds {describe_size(used)} of its {describe_size(limit)} limit "
        f"({describe_size(used + needed - limit)} over)"
    )
    if after is not None:
        text += f"; nothing more can be evicted (dropping every cold adapter would still leave {describe_size(after)})"
    if why:
        text += f"; {why}"
    fix = f". Held: {held}. Or raise --max-store-bytes" if held else "; unstage adapters (fabric unstage) or raise --max-store-bytes"
    return StoreFull(text + fix, needed, what)


def opened_with_room(open_writer: Callable[[], T], make_room: MakeRoom | None) -> T:
    """``open_writer()``; when the store refuses it for room, ``make_room`` is asked (outside every store lock) and it is opened
    once more. A second refusal (another writer took the room meanwhile) goes to the caller, who may retry."""
    try:
        return open_writer()
    except StoreFull as full:
        if make_room is None:
            raise
        make_room(full)
    return open_writer()


class Quota:
    """What the store holds and what it may still take."""

    def __init__(
        self,
        layout: StoreLayout,
        max_bytes: int | None = None,
        max_adapter_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.layout = layout
        #: the whole store's limit; None = no limit
        self.max_bytes = max_bytes
        #: largest adapter (config + weights) accepted from a client or a peer; None = no limit
        self.max_adapter_bytes = max_adapter_bytes
        #: largest safetensors header parsed or accepted
        self.max_header_bytes = max_header_bytes
        # key -> bytes still on their way to an open upload (it reserved them when it opened)
        self._pending: dict[str, Callable[[], int]] = {}
        self._pending_lock = threading.Lock()
        self._blob_bytes = DirSizes(layout.blobs)

    def usage(self) -> int:
        """Bytes held: committed blobs, every partial at its full size, uploads written plus what open ones reserved."""
        # blobs are immutable and many (cached per fan-out directory); partials and uploads grow in place and are few
        total = self._blob_bytes.total() + tree_bytes(self.layout.partials) + tree_bytes(self.layout.uploads)
        with self._pending_lock:
            pending = list(self._pending.values())
        return total + sum(max(0, unwritten()) for unwritten in pending)

    def hold_pending(self, key: str, unwritten: Callable[[], int]) -> None:
        """Count ``unwritten()`` bytes as used until ``release_pending(key)``: an open upload's unsent part is on its way."""
        with self._pending_lock:
            self._pending[key] = unwritten

    def release_pending(self, key: str) -> None:
        with self._pending_lock:
            self._pending.pop(key, None)

    def check_adapter_size(self, size: int, what: str) -> None:
        """One adapter (config + weights) of ``size`` bytes must fit --max-adapter-bytes."""
        if self.max_adapter_bytes is not None and size > self.max_adapter_bytes:
            raise LimitExceeded(
                f"{what}: the adapter is {size} bytes, over this node's limit of {self.max_adapter_bytes} (--max-adapter-bytes); nothing was written"
            )

    def check_manifest_limits(self, manifest: Manifest) -> None:
        """A manifest (from a peer) must fit the size limits before a byte of it is fetched."""
        what = f"downloading {manifest.adapter_id!r}"
        self.check_adapter_size(sum(f.size for f in manifest.files), what)
        if manifest.header_size > self.max_header_bytes:
            raise InvalidHeader(
                f"{what}: its safetensors header is {manifest.header_size} bytes, over this node's limit of "
                f"{self.max_header_bytes} (--max-header-bytes); nothing was written"
            )

    def check_room(self, needed: int, what: str) -> None:
        """``needed`` more bytes must fit the store's limit, or ``StoreFull`` (nothing is written, nothing else is asked)."""
        if self.max_bytes is None or needed == 0:
            return
        used = self.usage()
        if used + needed > self.max_bytes:
            raise quota_exceeded(needed, used, self.max_bytes, what)

    def over(self, share: float = 1.0) -> int:
        """Bytes held past ``share`` of the limit (0 when under it, or when there is no limit)."""
        if self.max_bytes is None:
            return 0
        return max(0, self.usage() - int(self.max_bytes * share))
