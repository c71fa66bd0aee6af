"""Which ids refer to each digest, and which live digests name each blob: what collecting after one change needs.

Built by a full collection (``adapter_fabric.store.recovery``) from the refs and
manifests it read, then kept in step by the committer under the store's lock.
Processes may share a store (each change under its ``flock``), so the
index is trusted only while the store's ref generation, a counter every ref
change bumps (``bump``, under the lock), is the one this process last saw.
The counter lives outside ``refs/``: a directory's time is too coarse to tell
two processes' changes within one tick apart.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

#: the store's ref generation, in the store root (a count, not durable: after a crash every process rebuilds)
REF_GENERATION_FILE = "refs.generation"


class LiveIndex:
    """id -> digest, digest -> ids, digest -> blob roots and root -> live digests naming it; trusted per ``current``."""

    def __init__(self, generation_file: Path) -> None:
        self.generation_file = generation_file
        self._seen: int | None = None  # None: never built, or given up on (a failed commit): collect whole
        #: how many times it was built whole: what is kept in step with it (``tenant_holdings``) is taken again after one
        self.epoch = 0
        self._digest_of: dict[str, str] = {}
        self._ids_of: dict[str, str | set[str]] = {}  # one id as itself (most digests have one): a set each is ~20 MB at 100,000
        self._roots_of: dict[str, tuple[str, ...]] = {}
        self._root_users: Counter[str] = Counter()

    # ------------------------------------------------------------ trust

    def current(self) -> bool:
        """True when no process changed refs since this index last saw them, and the store held no damage then."""
        return self._seen is not None and self._seen == self._read_generation()

    def invalidate(self) -> None:
        """A change may have half happened (a commit that failed): the next collection reads everything."""
        self._seen = None

    def bump(self) -> None:
        """This process changed refs (under the lock): others sharing the store will rebuild their index."""
        generation = self._read_generation()
        self._write_generation(generation + 1)
        # still trusted only if nobody else changed refs since this process last looked
        self._seen = generation + 1 if self._seen == generation else None

    # ------------------------------------------------------------ building and changes

    def rebuild(self, refs: dict[str, str], roots_of: dict[str, tuple[str, ...] | None], trustworthy: bool) -> None:
        """From a full collection: every ref, and the blob roots of each live manifest (None: unreadable).

        ``trustworthy`` False (a damaged ref or manifest): collections stay whole until the damage is gone.
        """
        self._seen = None  # not trusted while it is filled: a reader from another thread reads the refs meanwhile
        self.epoch += 1
        self._digest_of = dict(refs)
        self._ids_of = {}
        for adapter_id, digest in refs.items():
            self._add(digest, adapter_id)
        self._roots_of = {digest: roots for digest, roots in roots_of.items() if roots is not None}
        self._root_users = Counter(root for roots in self._roots_of.values() for root in set(roots))
        self._seen = self._read_generation() if trustworthy else None

    def ref_set(self, adapter_id: str, digest: str, roots: list[str]) -> None:
        """``adapter_id`` now refers to ``digest``, whose manifest names ``roots``."""
        previous = self._digest_of.get(adapter_id)
        if previous is not None and previous != digest:
            self._discard(previous, adapter_id)
        self._digest_of[adapter_id] = digest
        self._add(digest, adapter_id)
        if digest not in self._roots_of:
            self._roots_of[digest] = tuple(roots)
            self._root_users.update(set(roots))

    def ref_removed(self, adapter_id: str) -> None:
        digest = self._digest_of.pop(adapter_id, None)
        if digest is not None:
            self._discard(digest, adapter_id)

    def _add(self, digest: str, adapter_id: str) -> None:
        ids = self._ids_of.get(digest)
        if ids is None or ids == adapter_id:
            self._ids_of[digest] = adapter_id
        elif isinstance(ids, str):
            self._ids_of[digest] = {ids, adapter_id}
        else:
            ids.add(adapter_id)

    def _discard(self, digest: str, adapter_id: str) -> None:
        ids = self._ids_of.get(digest)
        if ids == adapter_id:
            del self._ids_of[digest]
        elif isinstance(ids, set):
            ids.discard(adapter_id)

    def unreferenced(self, digest: str) -> bool:
        """No id refers to ``digest`` (its bytes may go)."""
        return not self._ids_of.get(digest)

    def forget(self, digest: str) -> list[str]:
        """``digest`` is being removed: the blob roots no other live manifest names (they may go too)."""
        self._ids_of.pop(digest, None)
        roots: tuple[str, ...] = self._roots_of.pop(digest, ())
        unused = []
        for root in set(roots):
            self._root_users[root] -= 1
            if self._root_users[root] <= 0:
                del self._root_users[root]
                unused.append(root)
        return unused

    # ------------------------------------------------------------ reads from any thread, without the store's lock

    # Each read below is a lookup and a copy, each one step under the GIL: the answer is the index at one moment of the
    # call, as a scan of ``refs/`` is. None: the index is not trusted now (another process changed refs, or it was never
    # built): read the refs.

    def ids_referring(self, digest: str) -> list[str] | None:
        """The ids referring to ``digest``, sorted (a Fetch's or an Availability's check of a scoped caller, per call)."""
        if not self.current():
            return None
        ids = self._ids_of.get(digest)
        return [] if ids is None else [ids] if isinstance(ids, str) else sorted(ids)

    def digests(self) -> dict[str, str] | None:
        """Every id and the digest it refers to (an eviction's list, per round)."""
        if not self.current():
            return None
        return dict(self._digest_of)

    # ------------------------------------------------------------ the counter

    def generation(self) -> int:
        """The store's ref generation now (-1 when its file is damaged)."""
        return self._read_generation()

    def _read_generation(self) -> int:
        try:
            return int(self.generation_file.read_bytes() or b"0")
        except FileNotFoundError:
            return 0
        except ValueError:
            return -1  # damaged: never equal to what this process saw, so it rebuilds (and the next bump rewrites it)

    def _write_generation(self, generation: int) -> None:
        fd = os.open(self.generation_file, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            data = str(generation).encode("ascii").ljust(20)  # fixed width: a shorter number never leaves digits behind
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
