"""Reading what is committed: refs (id -> digest), manifests (cached), and whether an adapter's files are whole.

The catalog never writes; the committer (``adapter_fabric.store.committer``) tells
it when a manifest was written or removed so its cache stays true.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from adapter_fabric.errors import AdapterNotFound, FabricError, IntegrityError, InvalidArgument, StoreMissing
from adapter_fabric.store.files import decode_id
from adapter_fabric.store.ids import validate_adapter_id, validate_digest
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.manifest_cache import ManifestCache
from adapter_fabric.store.ref_index import RefIndex
from adapter_fabric.store.summaries import Summary, SummaryReader


@dataclass(frozen=True)
class Listed:
    """A staged id in a page of the listing: its digest's summary (None when unreadable) and, when damaged, the problem ("" else)."""

    adapter_id: str
    digest: str
    summary: Summary | None
    problem: str


def _is_id(name: str) -> bool:
    try:
        validate_adapter_id(name)
    except InvalidArgument:
        return False  # not a ref this store wrote
    return True


def is_digest(value: str) -> bool:
    """True when ``value`` is a well-formed digest (64 lowercase hex)."""
    try:
        validate_digest(value)
    except FabricError:
        return False
    return True


class Catalog:
    """Committed refs and manifests of one store, read through a per-digest manifest cache."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self._manifests = ManifestCache()
        # digest -> what scans of the whole store need (size, blob roots, content id, PEFT fields), kept for every digest
        # read (~0.3 KB each): a listing or a census reads no manifest twice, and builds none (adapter_fabric.store.summaries)
        self._summaries: dict[str, Summary] = {}
        self._reader = SummaryReader()
        self._manifests_dir = os.fspath(layout.manifests)
        #: the staged ids, sorted, for pages of a listing (kept in step by the committer's listener)
        self.index = RefIndex(layout.refs, self._scan_ids)

    # ------------------------------------------------------------ refs

    def read_ref(self, adapter_id: str) -> str | None:
        """The digest an id refers to; None when it is not staged. Damaged text is returned as it is (``problem`` reports it)."""
        try:
            return self.layout.ref(adapter_id).read_bytes().decode("ascii", "replace").strip()
        except FileNotFoundError:
            if not self.layout.refs.is_dir():  # not "not staged": the store itself went (checked only on a miss)
                raise self.missing_store() from None
            return None

    def refs(self, stamps: dict[str, int] | None = None) -> dict[str, str]:
        """Every staged id and the digest its entry holds; ``stamps``, when given, gets each id's recency stamp too (the
        ref's mtime in ns, ``keeping.Recency``), from the file already open."""
        found: dict[str, str] = {}
        try:
            entries = list(os.scandir(self.layout.refs))
        except FileNotFoundError:
            raise self.missing_store() from None
        for entry in entries:
            adapter_id = decode_id(entry.name)
            try:
                validate_adapter_id(adapter_id)
            except InvalidArgument:
                continue  # not a ref this store wrote
            try:
                with open(entry.path, "rb") as f:  # read_ref's reading, from the entry's own path (100,000 of them)
                    found[adapter_id] = f.read().decode("ascii", "replace").strip()
                    if stamps is not None:
                        stamps[adapter_id] = os.fstat(f.fileno()).st_mtime_ns
            except FileNotFoundError:
                continue  # unstaged while we read
        return found

    def stamps(self) -> dict[str, int]:
        """Each ref's recency stamp (its mtime in ns, ``keeping.Recency``) by the id its name decodes to, from one listing
        and a stat per entry: no ref opened, no name checked (callers pair them with ids they know)."""
        found: dict[str, int] = {}
        try:
            entries = os.scandir(self.layout.refs)
        except FileNotFoundError:
            raise self.missing_store() from None
        with entries:
            for entry in entries:
                try:
                    found[decode_id(entry.name)] = entry.stat(follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:
                    continue  # unstaged while we listed
        return found

    # ------------------------------------------------------------ manifests

    def load_manifest(self, digest: str, *, keep: bool = True) -> Manifest | None:
        """The manifest of ``digest``; None if absent; ``IntegrityError``/``InvalidAdapter`` if its file is damaged.

        ``keep`` False: a scan of every manifest (the scrub) reads it without pushing the ones in use out of the cache.
        """
        if not is_digest(digest):
            raise IntegrityError(f"{digest[:80]!r} is not a digest")
        path = self.layout.manifest(digest)
        cached = self._manifests.get(digest)
        if cached is not None and path.is_file():  # another process may have collected it
            return cached
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.forget(digest)
            return None
        manifest = Manifest.from_json(data)
        if manifest.digest != digest:
            raise IntegrityError(f"{path} holds the manifest of digest {manifest.digest}")
        if keep:
            self.remember(manifest)
        return manifest

    def summaries(self, digests: Iterable[str]) -> dict[str, Summary]:
        """``summary`` of each of ``digests`` whose manifest is here and reads; the others left out. Which are here comes
        from one listing of ``manifests/``, not a stat each (an eviction's list asks for every digest held)."""
        try:
            present = set(os.listdir(self._manifests_dir))
        except FileNotFoundError:
            raise self.missing_store() from None
        found: dict[str, Summary] = {}
        for digest in digests:
            if f"{digest}.json" not in present:
                self.forget(digest)  # collected by another process, or removed by hand (as ``summary`` does)
                continue
            summary = self._summaries.get(digest)
            if summary is None:
                try:
                    summary = self.summary(digest)
                except FabricError:
                    continue  # damaged (or no digest at all): the census reports it
            if summary is not None:
                found[digest] = summary
        return found

    def summary(self, digest: str) -> Summary | None:
        """The size and blob roots of ``digest`` without holding its manifest; None if absent; errors as ``load_manifest``."""
        if not is_digest(digest):
            raise IntegrityError(f"{digest[:80]!r} is not a digest")
        path = os.path.join(self._manifests_dir, f"{digest}.json")
        summary = self._summaries.get(digest)
        if summary is not None and os.path.isfile(path):
            return summary
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.forget(digest)
            return None
        summary = self._summaries[digest] = self._reader.read(digest, data)
        return summary

    def summarize(self, digest: str, data: bytes) -> Summary | None:
        """The summary of ``digest`` from its manifest file's bytes, kept; None when they are damaged (``problem`` says why)."""
        try:
            summary = self._summaries[digest] = self._reader.read(digest, data)
        except FabricError:
            return None
        return summary

    def remember(self, manifest: Manifest) -> None:
        """The committer wrote ``manifest``'s file (or it was read): no need to read it back."""
        self._manifests.put(manifest)
        if manifest.digest not in self._summaries:
            self._summaries[manifest.digest] = self._reader.of_manifest(manifest)

    def forget(self, digest: str) -> None:
        """The committer removed ``digest``'s manifest file."""
        self._manifests.drop(digest)
        self._summaries.pop(digest, None)

    def complete(self, digest: str) -> Manifest | None:
        """The manifest of ``digest`` when it and every blob it names are here; None when any is absent or damaged."""
        try:
            manifest = self.load_manifest(digest)
        except FabricError:
            return None
        if manifest is None or any(not self.layout.blob(f.root).is_file() for f in manifest.files):
            return None
        return manifest

    def missing_bytes(self, manifest: Manifest) -> int:
        """What committing ``manifest`` would add: the sizes of its files whose blobs are not here."""
        return sum(f.size for f in manifest.files if not self.layout.blob(f.root).is_file())

    # ------------------------------------------------------------ the public reads

    def get(self, adapter_id: str) -> Manifest:
        """The committed manifest of an id (``AdapterNotFound`` naming the id; ``IntegrityError`` when damaged)."""
        validate_adapter_id(adapter_id)
        digest = self.read_ref(adapter_id)
        if digest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        try:
            manifest = self.load_manifest(digest)
        except FabricError as exc:
            problem = self.problem(digest) or f"its manifest is damaged: {str(exc)[:200]}"  # a claim only the whole manifest checks
            raise IntegrityError(f"adapter {adapter_id!r} is damaged in this store: {problem}; unstage it, or promote it from a peer") from None
        if manifest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        return manifest.with_id(adapter_id)

    def by_digest(self, digest: str, referring: Callable[[str], builtins.list[str]] | None = None) -> Manifest | None:
        """The committed manifest of a digest, under one of the ids referring to it; None if absent. ``referring``: how to
        find those ids when the manifest's own id left the digest (default ``ids_referring``)."""
        validate_digest(digest)
        manifest = self.complete(digest)
        if manifest is None:
            return None
        if self.read_ref(manifest.adapter_id) == digest:
            return manifest
        ids = (referring or self.ids_referring)(digest)
        return manifest.with_id(ids[0]) if ids else None

    def ids_referring(self, digest: str) -> builtins.list[str]:
        """The ids whose ref names ``digest``, sorted, from every ref read: O(refs) (the store asks its live index first)."""
        return sorted(i for i, d in self.refs().items() if d == digest)

    def list(self) -> builtins.list[Manifest]:
        """Every committed adapter whose manifest reads, sorted by id; a damaged entry is left out (``problem`` names it)."""
        return list(self.each())

    def each(self, *, keep: bool = True) -> Iterator[Manifest]:
        """``list``, one manifest at a time: a scan of 100,000 adapters holds one, not all (~8 KB each); ``keep`` as ``load_manifest``."""
        for adapter_id, digest in sorted(self.refs().items()):
            try:
                manifest = self.load_manifest(digest, keep=keep)
            except FabricError:
                continue
            if manifest is not None:  # else unstaged while we listed
                yield manifest.with_id(adapter_id)

    def _scan_ids(self) -> builtins.list[str]:
        """Every name in ``refs/`` that is an id (not read: what the index is built from)."""
        return [n for n in (decode_id(entry.name) for entry in os.scandir(self.layout.refs)) if _is_id(n)]

    def page(self, after: str, count: int, keep: Callable[[str], bool] | None = None) -> builtins.list[Listed]:
        """Up to ``count`` staged ids sorted after ``after`` ("" = from the first), each with its manifest or its problem.

        ``keep``: only ids it answers true for are listed (a caller's readable ids), chosen before the page is cut.

        Only the page's entries are read, each digest's manifest once (its summary, ``adapter_fabric.store.summaries``): the ids
        come from the sorted index (``adapter_fabric.store.ref_index``).
        """
        try:
            ids = self.index.page(after, count, keep)
        except FileNotFoundError:
            raise self.missing_store() from None
        listed: builtins.list[Listed] = []
        for adapter_id in ids:
            digest = self.read_ref(adapter_id)
            if digest is None:
                continue  # unstaged while we listed
            problem = self.problem(digest)
            summary = self._summaries.get(digest) if is_digest(digest) else None  # read by ``problem`` when it reads
            if summary is None and not problem:
                continue  # collected while we listed
            listed.append(Listed(adapter_id, digest, summary, problem))
        return listed

    # ------------------------------------------------------------ damage

    def problem(self, digest: str) -> str:
        """Why the adapter behind ``digest`` is damaged; "" when it is not (as far as files' presence shows)."""
        if not is_digest(digest):
            return f"its id entry is damaged (holds {digest[:80]!r}, not a digest)"
        try:
            summary = self.summary(digest)
        except FabricError as exc:
            return f"its manifest is damaged: {str(exc)[:200]}"
        if summary is None:
            return f"its manifest {digest}.json is missing"
        blobs = os.fspath(self.layout.blobs)  # string paths: a status census asks this of every id
        for root in summary.roots:
            if not os.path.isfile(os.path.join(blobs, root[:2], root)):
                return f"its {self._file_name(digest, root)} (blob {root}) is missing or quarantined"
        return ""

    def _file_name(self, digest: str, root: str) -> str:
        """The name of the file a manifest lists under blob ``root`` ("file" when the manifest does not read)."""
        try:
            manifest = self.load_manifest(digest)
        except FabricError:
            manifest = None
        return next((f.name for f in manifest.files if f.root == root), "file") if manifest is not None else "file"

    def check_present(self) -> None:
        """Raise ``missing_store()`` when the store's root, its format marker or a core directory is gone.

        The marker counts: a writer that recreated a directory of a deleted store (a lock file, an upload's folder) does
        not make it a store again.
        """
        layout = self.layout
        if not (layout.format_marker.is_file() and all(d.is_dir() for d in (layout.refs, layout.manifests, layout.blobs))):
            raise self.missing_store()

    def missing_store(self) -> StoreMissing:
        """The error for a store whose directory (or a part of it) was removed while this process uses it."""
        layout = self.layout
        parts = (layout.root, layout.format_marker, layout.refs, layout.manifests, layout.blobs)
        gone = next((d for d in parts if not (d.is_file() if d == layout.format_marker else d.is_dir())), layout.refs)
        what = "is missing" if gone in (layout.root, layout.format_marker) else f"is missing its {gone.relative_to(layout.root)}/ directory"
        return StoreMissing(
            f"the adapter store {layout.root} {what} (removed while the node runs): "
            "restore it, or restart the node to start an empty store there and pull adapters from peers again"
        )
