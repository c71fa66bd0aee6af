"""Store limits: the size of one adapter, its header, and the bytes the whole store may hold.

What happens when a commit would pass the store's limit is a policy handed
in (``WhenFull``): today the store refuses (``RefuseWhenFull``); a cache policy
that drops cold adapters plugs in here without the store changing.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from adapter_fabric.errors import InvalidHeader, LimitExceeded, QuotaExceeded
from adapter_fabric.format.safetensors_index import MAX_HEADER_BYTES
from adapter_fabric.store.dir_sizes import DirSizes, tree_bytes
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.units import describe_size


class WhenFull(Protocol):
    """Decides what to do when ``needed`` more bytes would take the store past its limit."""

    def make_room(self, needed: int, used: int, limit: int, what: str) -> None:
        """Free what it can (the quota measures again afterwards), or raise ``QuotaExceeded`` naming why it cannot.

        Never called with the store's lock held (that lock is not re-entrant),
        so it may remove adapters through the store's own paths (``unstage``).
        """
        ...


def quota_exceeded(needed: int, used: int, limit: int, what: str, why: str = "", *, held: str = "", after: int | None = None) -> QuotaExceeded:
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
    if held:
        return QuotaExceeded(f"{text}. Held: {held}. Or raise --max-store-bytes")
    return QuotaExceeded(f"{text}; unstage adapters (fabric unstage) or raise --max-store-bytes")


class RefuseWhenFull:
    """The store never drops anything on its own: a commit past the limit is refused (``why``: named in the refusal)."""

    def __init__(self, why: str = "") -> None:
        self.why = why

    def make_room(self, needed: int, used: int, limit: int, what: str) -> None:
        raise quota_exceeded(needed, used, limit, what, self.why)


class Quota:
    """What the store holds and what it may still take."""

    def __init__(
        self,
        layout: StoreLayout,
        max_bytes: int | None = None,
        max_adapter_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        when_full: WhenFull | None = None,
    ) -> None:
        self.layout = layout
        #: the whole store's limit; None = no limit
        self.max_bytes = max_bytes
        #: largest adapter (config + weights) accepted from a client or a peer; None = no limit
        self.max_adapter_bytes = max_adapter_bytes
        #: largest safetensors header parsed or accepted
        self.max_header_bytes = max_header_bytes
        self.when_full: WhenFull = when_full or RefuseWhenFull()
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

    def check_room(self, needed: int, what: str, *, lock_held: bool = False) -> None:
        """``needed`` more bytes must fit the store's limit; past it, the ``WhenFull`` policy frees room or refuses.

        ``lock_held``: the caller holds the store's lock (the committer's re-check): refuse without asking the policy,
        which was asked before the bytes were written and may need the lock to free room.
        """
        if self.max_bytes is None or needed == 0:
            return
        used = self.usage()
        if used + needed <= self.max_bytes:
            return
        if lock_held:
            raise quota_exceeded(needed, used, self.max_bytes, what)
        self.when_full.make_room(needed, used, self.max_bytes, what)
        used = self.usage()
        if used + needed > self.max_bytes:
            raise quota_exceeded(needed, used, self.max_bytes, what)
