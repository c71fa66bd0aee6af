"""Where each adapter lives in a fleet: ``k`` homes per adapter id by rendezvous (HRW) hashing over the members. Pure.

Keyed by the adapter id (the part before an ``@`` pin), not by the digest: a miss knows only the id (``fabric pull
--id``, an engine's resolver asking by name, an origin's path), so its homes are known before anything is asked; a
digest would cost a lookup to learn first. An id that moves to a new digest keeps its homes (they revalidate it at its
origin); two ids naming one digest may have different homes (each node still stores the bytes once, by content).

Each member scores each id, ``splitmix64(hash(id) XOR hash(member))`` (both hashes the first 8 bytes of BLAKE3, as
Dynamo's placement hashes with blake3); the ``k`` highest scores are the id's homes, in order: the first is its
*first home* (the one that fetches it from an origin). A member joining takes a home only where it outscores an
id's ``k``-th home, one leaving gives up only its own homes: about ``1/n`` of all homes move either way, and nothing
else does (``moved``). Every node that knows the same members computes the same homes, with no coordination.

Scores for a large fleet are one vectorised pass (numpy: 64-bit wrap-around arithmetic, exactly ``score``'s); a
node ranks an eviction round's 100,000 ids over 1,000 members in chunks, the simulation 10,000 members
(``scripts/sim_fleet.py``). No I/O, no clock, no threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blake3 import blake3

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEFAULT_HOMES", "Fleet", "first_live", "home_id", "id_key", "member_key", "member_scores", "moved", "pair_scores", "score"]

#: homes per adapter (--homes)
DEFAULT_HOMES = 3
_MASK = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
#: scores computed at once in ``Fleet.homes_of_many`` (ids x members): about 32 MiB of uint64
_CHUNK_CELLS = 1 << 22


def _np() -> Any:
    """numpy, imported on first use (a store-only node's start-up imports none of the numeric stack)."""
    import numpy

    return numpy


def home_id(adapter_id: str) -> str:
    """The part of an id its homes are computed from: ``ID@REVISION`` is homed with ``ID`` (every pin of an id together)."""
    return adapter_id.split("@", 1)[0]


def id_key(adapter_id: str) -> int:
    """The 64-bit hash of an id's home part."""
    return int.from_bytes(blake3(b"fabric-id\0" + home_id(adapter_id).encode()).digest(8), "little")


def member_key(address: str) -> int:
    """The 64-bit hash of a member's address (lower-cased: members are compared as text, case-blind)."""
    return int.from_bytes(blake3(b"fabric-member\0" + address.lower().encode()).digest(8), "little")


def score(key: int, member: int) -> int:
    """A member's score for an id (the reference; ``Fleet`` computes the same, vectorised)."""
    z = (key ^ member) & _MASK
    z = ((z ^ (z >> 30)) * _C1) & _MASK
    z = ((z ^ (z >> 27)) * _C2) & _MASK
    return z ^ (z >> 31)


def _scores(keys: np.ndarray) -> np.ndarray:
    """``score`` over an array of ``id_key ^ member_key`` values (uint64; wrap-around is the point), in place."""
    np = _np()
    z = keys if keys.dtype == np.uint64 else keys.astype(np.uint64)
    shifted = np.empty_like(z)
    with np.errstate(over="ignore"):
        for shift, factor in ((30, _C1), (27, _C2), (31, 0)):
            np.right_shift(z, np.uint64(shift), out=shifted)
            z ^= shifted
            if factor:
                z *= np.uint64(factor)
    return z


def pair_scores(keys: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``score`` of each ``keys[i]`` (an ``id_key``) for ``members[i]`` (a ``member_key``), as uint64 arrays."""
    return _scores(keys ^ members)


def member_scores(address: str, keys: np.ndarray) -> np.ndarray:
    """One member's score for each of ``keys`` (``id_key`` values, uint64): where a newcomer would outscore a home."""
    np = _np()
    return _scores(keys ^ np.uint64(member_key(address)))


@dataclass(frozen=True)
class Fleet:
    """The members (lower-cased, sorted, each once) and their keys; every node with the same members ranks alike."""

    members: tuple[str, ...]
    keys: np.ndarray = field(repr=False, compare=False)

    @staticmethod
    def of(addresses: Iterable[str]) -> Fleet:
        np = _np()
        members = tuple(sorted({a.lower() for a in addresses}))
        return Fleet(members, np.array([member_key(m) for m in members], dtype=np.uint64))

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, address: object) -> bool:
        return isinstance(address, str) and address.lower() in self._index

    @property
    def _index(self) -> dict[str, int]:
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {m: i for i, m in enumerate(self.members)}
            object.__setattr__(self, "_index_cache", index)
        return index

    def scores(self, adapter_id: str) -> np.ndarray:
        """Every member's score for ``adapter_id``, in ``members`` order."""
        np = _np()
        return _scores(self.keys ^ np.uint64(id_key(adapter_id)))

    def ranked(self, adapter_id: str, limit: int | None = None) -> list[str]:
        """The members by score for ``adapter_id``, highest first (the first ``limit`` only, when given)."""
        n = len(self.members)
        if n == 0:
            return []
        return [self.members[i] for i in _top(self.scores(adapter_id), n if limit is None else min(limit, n))]

    def homes(self, adapter_id: str, k: int = DEFAULT_HOMES) -> list[str]:
        """The ``k`` homes of ``adapter_id``, first home first (every member when there are ``k`` or fewer)."""
        return self.ranked(adapter_id, k)

    def is_home(self, adapter_id: str, member: str, k: int = DEFAULT_HOMES) -> bool:
        return member.lower() in self.homes(adapter_id, k)

    def homes_of_many(self, adapter_ids: Sequence[str], k: int = DEFAULT_HOMES) -> list[list[str]]:
        """``homes`` of each id, computed a chunk of ids at a time (one matrix of scores per chunk)."""
        np = _np()
        n = len(self.members)
        if n == 0:
            return [[] for _ in adapter_ids]
        k = min(k, n)
        rows = max(1, _CHUNK_CELLS // n)
        out: list[list[str]] = []
        for start in range(0, len(adapter_ids), rows):
            chunk = adapter_ids[start : start + rows]
            keys = np.array([id_key(a) for a in chunk], dtype=np.uint64)
            top = _top_rows(_scores(keys[:, None] ^ self.keys[None, :]), k)
            members = self.members
            out.extend([members[i] for i in row] for row in top.tolist())
        return out


def _top(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the ``k`` highest scores, highest first (ties: the earlier member, i.e. the lower address)."""
    np = _np()
    n = len(scores)
    if k <= 0:
        return []
    if k < n:
        picked = np.argpartition(scores, n - k)[n - k :]
    else:
        picked = np.arange(n)
    return sorted(picked.tolist(), key=lambda i: (-int(scores[i]), i))


def _top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row, the column indices of the ``k`` highest scores, highest first (``scores`` is overwritten)."""
    np = _np()
    rows = np.arange(scores.shape[0])
    if k <= 8:  # a few passes of argmax beat a partition of every row
        picked = np.empty((scores.shape[0], k), dtype=np.intp)
        for i in range(k):
            picked[:, i] = best = scores.argmax(axis=1)
            scores[rows, best] = 0
        return picked
    n = scores.shape[1]
    top = np.argpartition(scores, n - k, axis=1)[:, n - k :] if k < n else np.tile(np.arange(n), (len(rows), 1))
    order = np.argsort(np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")[:, ::-1]
    return np.take_along_axis(top, order, axis=1)


def first_live(order: Sequence[str], down: Iterable[str]) -> str | None:
    """The first of ``order`` not marked ``down`` (an id's first live home, say), or None."""
    out = set(down)
    return next((m for m in order if m not in out), None)


def moved(before: Sequence[Sequence[str]], after: Sequence[Sequence[str]]) -> int:
    """How many home assignments changed between two placements of the same ids (a home gained counts once)."""
    return sum(len(set(new) - set(old)) for old, new in zip(before, after, strict=False))
