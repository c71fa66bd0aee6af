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

Bytes a tenant left count too, until they expire (``--expire-abandoned-after``) or
are resumed: an upload or partial download no writer holds any more (a Stage
stream cut short, a failed pull, bytes kept for a resume) counts its bytes on
disk against the tenant of the id it was opened for (``hygiene.left_bytes``);
one a writer holds counts through that writer's reservation instead.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.hygiene import LeftBytes, left_bytes
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.lock_watch import WatchedLock
from adapter_fabric.store.tenant_holdings import TenantHoldings
from adapter_fabric.units import format_size


class TenantLimits(Protocol):
    """One tenant's quota as the store takes it (``adapter_fabric.access.policy.TenantQuota`` is one): plain values, no behaviour."""

    @property
    def prefix(self) -> str:
        """The id prefix, lower-case, ending in ``/``."""

    @property
    def max_bytes(self) -> int | None:
        """None: not limited."""

    @property
    def max_adapters(self) -> int | None:
        """None: not limited."""


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
    """What one tenant's committed ids hold (their names and the sizes of the distinct blobs they refer to), and the bytes
    of the uploads and partial downloads its ids left behind."""

    ids: set[str]
    roots: dict[str, int]
    left: int = 0


#: the uploads and partial downloads in the store, each with its id and bytes, but those named (the ones writers hold:
#: ``hygiene.left_bytes`` over the layout)
LeftBehind = Callable[[set[str]], list[LeftBytes]]


class TenantReservation:
    """Bytes and ids held for one writer until ``release`` (idempotent); a context manager that releases on exit."""

    def __init__(self, quotas: TenantQuotas, key: int) -> None:
        self._quotas = quotas
        self._key: int | None = key

    def release(self) -> None:
        """Give back what this writer reserved (committed, refused or failed alike)."""
        if self._key is not None:
            self._quotas.release(self._key)
            self._key = None

    def __enter__(self) -> TenantReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TenantQuotas:
    """The quotas of one store and the reservations its open writers hold."""

    def __init__(
        self, catalog: Catalog, quotas: tuple[TenantLimits, ...] = (), left_behind: LeftBehind | None = None, *,
        holdings: TenantHoldings,
    ) -> None:  # fmt: skip
        """``holdings``: what each quota's committed ids hold, kept in step with the store's commits (``tenant_holdings``)."""
        self._holdings = holdings
        self.catalog = catalog
        self._quotas = tuple(quotas)
        self._left_behind = left_behind or (lambda writing: left_bytes(catalog.layout, skip=writing))
        self._lock = WatchedLock("tenant quotas")  # one check-and-reserve at a time: two writers cannot both take the last room
        # key -> (id, its files' roots -> sizes, the upload or partial directory it writes, "" for none)
        self._reserved: dict[int, tuple[str, dict[str, int], str]] = {}
        self._keys = itertools.count(1)

    @property
    def quotas(self) -> tuple[TenantLimits, ...]:
        """The quotas in force (in the policy file's order)."""
        return self._quotas

    def set_quotas(self, quotas: tuple[TenantLimits, ...]) -> None:
        """Replace the quotas (a policy reload); open reservations stay held and count against the new ones."""
        self._quotas = tuple(quotas)

    def reserve(self, adapter_id: str, roots: dict[str, int], what: str, writes: str = "") -> TenantReservation:
        """Hold room for ``adapter_id`` referring to files ``roots`` (root -> size), or raise ``QuotaExceeded`` naming the prefix.

        ``writes``: the upload or partial directory (its name) the writer holds while it runs: what it left there before
        counts through this reservation now, not twice. Called before any byte arrives; nothing is held when it raises.
        """
        validate_adapter_id(adapter_id)
        key = next(self._keys)
        with self._lock:
            quotas = [q for q in self._quotas if covers(q, adapter_id)]
            if quotas:
                held = self._committed(quotas, also_writing=writes)
                for quota in quotas:
                    self._check(quota, held[quota.prefix], adapter_id, roots, what)
            self._reserved[key] = (adapter_id, dict(roots), writes)
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
        used = sum(have.values()) + held.left
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
                f"{what}: tenant {quota.prefix!r} is at {problem}{'; ' + str(held.left) + ' of them in uploads and partial downloads it left' if held.left else ''}; "
                f"nothing was written. Unstage {quota.prefix} adapters, resume or let expire what it left, or raise the tenant's quota in the policy file"
            )

    def _usage(self, quota: TenantLimits, held: _Held) -> TenantUsage:
        ids, roots = self._with_reserved(quota, held)
        return TenantUsage(quota.prefix, quota.max_bytes, quota.max_adapters, sum(roots.values()) + held.left, len(ids))

    def _with_reserved(self, quota: TenantLimits, held: _Held) -> tuple[set[str], dict[str, int]]:
        """Committed plus reserved: the ids (each once) and the blobs (each once, by root) the tenant holds or has on its way."""
        ids, roots = set(held.ids), dict(held.roots)
        for adapter_id, reserved_roots, _ in self._reserved.values():
            if covers(quota, adapter_id):
                ids.add(adapter_id)
                for root, size in reserved_roots.items():
                    roots.setdefault(root, size)
        return ids, roots

    def _committed(self, quotas: list[TenantLimits], also_writing: str = "") -> dict[str, _Held]:
        """What the committed ids under each quota's prefix refer to (kept between calls: ``tenant_holdings``), and the bytes
        of the uploads and partials its ids left that no writer holds (nor ``also_writing``)."""
        held = {q.prefix: _Held(set(), {}) for q in quotas}
        if not quotas:
            return held
        writing = {w for _, _, w in self._reserved.values() if w} | ({also_writing} if also_writing else set())
        for left in self._left_behind(writing):
            if left.key not in writing:
                for quota in quotas:
                    if covers(quota, left.adapter_id):
                        held[quota.prefix].left += left.bytes
        kept = self._holdings.read(tuple(q.prefix for q in self._quotas), held)
        for prefix, (ids, roots) in kept.items():
            held[prefix].ids, held[prefix].roots = ids, roots
        return held
