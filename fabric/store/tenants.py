"""Per-tenant quotas: bytes and adapter ids per id prefix, beside the store-wide limit.

A tenant is an id prefix (``team-a/``, matched case-blind per ``/`` segment
like the access policy). Its usage is what its ids refer to: the count of
staged ids under the prefix, and the bytes of the distinct files (blob roots)
they name; bytes two tenants share (the same content staged by both) count
for each. Every writer reserves before a byte arrives, exactly like the
store's quota: a Stage upload when it opens (its declared size), a pull when
its partial opens (the manifest's size), a directory stage once checked; a
reference to bytes already here reserves too (one more id). The reservation
counts until the writer ends, committed or not, so concurrent writers of one
tenant cannot pass its limit together; for the instant between a commit and
its release both are counted (a refusal then errs on the safe side).

A tenant past its quota is refused (``QuotaExceeded`` naming the prefix, its
limit and usage) before the store's own limit is asked, so it never makes an
evicting store drop other tenants' adapters; nor are its own cold adapters
dropped to make room: a quota bounds what a tenant publishes, and quietly
unpublishing its adapters is the operator's call (unstage), not the store's.

The quotas are a plain tuple handed in (``AdapterStore(tenant_quotas=...)``,
``set_quotas`` on a policy reload); the access policy file parses them
(``adapter_fabric.access.policy``), which bounds how many there are.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Protocol

from adapter_fabric.errors import FabricError, QuotaExceeded
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.files import decode_id
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.units import format_size
from adapter_fabric.store.lock_watch import WatchedLock

class TenantLimits(Protocol):
    """One tenant's quota as the store takes it (``adapter_fabric.access.policy.TenantQuota`` is one): plain values, no behaviour."""

    #: the id prefix, lower-case, ending in ``/``
    prefix: str
    #: None: not limited
    max_bytes: int | None
    max_adapters: int | None


def covers(quota: TenantLimits, adapter_id: str) -> bool:
    """Whether ``adapter_id`` is under the quota's prefix (case-blind, whole segments: the prefix ends in ``/``)."""
    return adapter_id.lower().startswith(quota.prefix)


@dataclass(frozen=True)
class TenantUsage:
    """What one tenant holds against its quota: committed plus reserved by writers still open."""

    prefix: str
    max_bytes: int | None
    max_adapters: int | None
    bytes: int
    adapters: int


@dataclass
class _Held:
    """What one tenant's committed ids hold: their names and the sizes of the distinct blobs they refer to."""

    ids: set[str]
    roots: dict[str, int]


class TenantReservation:
    """Bytes and ids held for one writer until ``release`` (idempotent); a context manager that releases on exit."""

    def __init__(self, quotas: "TenantQuotas", key: int) -> None:
        self._quotas = quotas
        self._key: int | None = key

    def release(self) -> None:
        """Give back what this writer reserved (committed, refused or failed alike)."""
        if self._key is not None:
            self._quotas.release(self._key)
            self._key = None

    def __enter__(self) -> "TenantReservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TenantQuotas:
    """The quotas of one store and the reservations its open writers hold."""

    def __init__(self, catalog: Catalog, quotas: tuple[TenantLimits, ...] = ()) -> None:
        self.catalog = catalog
        self._quotas = tuple(quotas)
        self._lock = WatchedLock("tenant quotas")  # one check-and-reserve at a time: two writers cannot both take the last room
        self._reserved: dict[int, tuple[str, dict[str, int]]] = {}  # key -> (id, its files' roots -> sizes)
        self._keys = itertools.count(1)

    @property
    def quotas(self) -> tuple[TenantLimits, ...]:
        """The quotas in force (in the policy file's order)."""
        return self._quotas

    def set_quotas(self, quotas: tuple[TenantLimits, ...]) -> None:
        """Replace the quotas (a policy reload); open reservations stay held and count against the new ones."""
        self._quotas = tuple(quotas)

    def reserve(self, adapter_id: str, roots: dict[str, int], what: str) -> TenantReservation:
        """Hold room for ``adapter_id`` referring to files ``roots`` (root -> size), or raise ``QuotaExceeded`` naming the prefix.

        Called before any byte arrives; nothing is held when it raises.
        """
        validate_adapter_id(adapter_id)
        key = next(self._keys)
        with self._lock:
            quotas = [q for q in self._quotas if covers(q, adapter_id)]
            if quotas:
                held = self._committed(quotas)
                for quota in quotas:
                    self._check(quota, held[quota.prefix], adapter_id, roots, what)
            self._reserved[key] = (adapter_id, dict(roots))
        return TenantReservation(self, key)

    def release(self, key: int) -> None:
        """Forget reservation ``key`` (``TenantReservation.release`` calls it)."""
        with self._lock:
            self._reserved.pop(key, None)

    def usage(self) -> list[TenantUsage]:
        """Each quota with what its tenant holds now (committed and reserved); as many entries as quotas."""
        with self._lock:
            held = self._committed(list(self._quotas))
            return [self._usage(q, held[q.prefix]) for q in self._quotas]

    # ------------------------------------------------------------ measuring (under self._lock)

    def _check(self, quota: TenantLimits, held: _Held, adapter_id: str, roots: dict[str, int], what: str) -> None:
        ids, have = self._with_reserved(quota, held)
        used = sum(have.values())
        more = sum(size for root, size in roots.items() if root not in have)
        problem = ""
        if quota.max_adapters is not None and adapter_id not in ids and len(ids) + 1 > quota.max_adapters:
            problem = f"its limit of {quota.max_adapters} adapters (it holds {len(ids)})"
        elif quota.max_bytes is not None and used + more > quota.max_bytes:
            problem = (
                f"its limit of {format_size(quota.max_bytes)} ({quota.max_bytes} bytes; it holds {used}, "
                f"{more} more would be {used + more - quota.max_bytes} over)"
            )
        if problem:
            raise QuotaExceeded(
                f"{what}: tenant {quota.prefix!r} is at {problem}; nothing was written. "
                f"Unstage {quota.prefix} adapters or raise the tenant's quota in the policy file"
            )

    def _usage(self, quota: TenantLimits, held: _Held) -> TenantUsage:
        ids, roots = self._with_reserved(quota, held)
        return TenantUsage(quota.prefix, quota.max_bytes, quota.max_adapters, sum(roots.values()), len(ids))

    def _with_reserved(self, quota: TenantLimits, held: _Held) -> tuple[set[str], dict[str, int]]:
        """Committed plus reserved: the ids (each once) and the blobs (each once, by root) the tenant holds or has on its way."""
        ids, roots = set(held.ids), dict(held.roots)
        for adapter_id, reserved_roots in self._reserved.values():
            if covers(quota, adapter_id):
                ids.add(adapter_id)
                for root, size in reserved_roots.items():
                    roots.setdefault(root, size)
        return ids, roots

    def _committed(self, quotas: list[TenantLimits]) -> dict[str, _Held]:
        """What the committed ids under each quota's prefix refer to: one scan of the ref names, reading only the matching refs."""
        held = {q.prefix: _Held(set(), {}) for q in quotas}
        if not quotas:
            return held
        try:
            names = [entry.name for entry in os.scandir(self.catalog.layout.refs)]
        except FileNotFoundError:
            raise self.catalog.missing_store() from None
        for name in names:
            adapter_id = decode_id(name)
            mine = [q for q in quotas if covers(q, adapter_id)]
            if not mine:
                continue
            digest = self.catalog.read_ref(adapter_id)
            try:
                manifest = self.catalog.load_manifest(digest) if digest else None
            except FabricError:
                manifest = None  # damaged: its id counts, its bytes are unknown (store-status names it)
            for quota in mine:
                entry = held[quota.prefix]
                entry.ids.add(adapter_id)
                for f in manifest.files if manifest is not None else ():
                    entry.roots[f.root] = f.size
        return held
