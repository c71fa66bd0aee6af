"""Restart recovery and garbage collection: temp files, orphans, dead partials and uploads go; live data stays.

Both run under the store's lock (``adapter_fabric.store.committer.Committer.locked``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.durable import fsync_dir
from adapter_fabric.store.files import remove_if_unheld, try_lock, writer_alive
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.live_index import REF_GENERATION_FILE, LiveIndex

_DIGEST = re.compile(r"[0-9a-f]{64}")


class Collected(NamedTuple):
    """What a full collection read: every ref, and the digests whose manifest reads whole and whose every blob is in
    place (None when the blobs were not listed: damage kept the collection from them)."""

    refs: dict[str, str]
    whole: set[str] | None


class GarbageCollector:
    """Removes manifests, views, signatures and blobs that no ref reaches.

    ``collect`` reads every ref and live manifest: O(adapters), ~4 s at 100,000.
    Restart recovery runs it once and keeps what it read (``LiveIndex``), so
    an unstage, an eviction or a restage afterwards collects only the digest
    it left unreferenced (``collect_digests``). The index is trusted only while
    the store's ref generation is the one this process last saw: every ref
    change, by any process sharing the store, bumps it under the lock.
    """

    def __init__(self, layout: StoreLayout, catalog: Catalog) -> None:
        self.layout = layout
        self.catalog = catalog
        self.live = LiveIndex(layout.root / REF_GENERATION_FILE)

    def collect(self) -> Collected:
        """Remove what no ref reaches (under the lock), and rebuild the live index from what it read; what it read.

        Damage makes it keep more, never less: while an id entry does not hold
        a digest, nothing is collected (it may point at any manifest); while a
        referenced manifest is missing or unreadable, no blob is (it may name any).
        """
        layout = self.layout
        refs = self.catalog.refs()
        live = {digest: digest for digest in refs.values()}  # one string per digest, kept by every index built below
        refs = {adapter_id: live[digest] for adapter_id, digest in refs.items()}
        sound_refs = all(_DIGEST.fullmatch(d) for d in live)
        keep: set[str] = set()
        roots_of: dict[str, tuple[str, ...] | None] = {}
        summarized: set[str] = set()
        blobs_known = sound_refs
        for entry in os.scandir(layout.manifests):
            name = entry.name.removesuffix(".json")
            digest = live.get(name)
            if digest is not None:
                roots = roots_of[digest] = self._blob_roots(digest, entry.path, summarized)
                blobs_known &= roots is not None
                keep.update(roots or ())
            elif sound_refs:
                os.unlink(entry.path)
                self.catalog.forget(name)
        blobs_known &= sound_refs and len(roots_of) == len(live)  # every live digest's manifest was among those read
        self.live.rebuild(refs, roots_of, sound_refs and blobs_known)
        for top in (layout.signatures, layout.signers):
            for entry in os.scandir(top):
                if entry.name not in live and sound_refs and not (layout.partials / entry.name).is_dir():
                    # kept while a pull of its digest may still commit
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
        for entry in os.scandir(layout.views):
            if entry.name not in live and sound_refs:
                shutil.rmtree(entry.path, ignore_errors=True)
        whole = None
        if blobs_known:
            present: set[str] = set()
            for bucket in os.scandir(layout.blobs):
                for blob in os.scandir(bucket.path):
                    if blob.name not in keep:
                        os.unlink(blob.path)
                    else:
                        present.add(blob.name)
            whole = {d for d in summarized if all(root in present for root in roots_of[d] or ("",))}
        fsync_dir(layout.manifests)
        return Collected(refs, whole)

    def collect_digests(self, digests: set[str]) -> None:
        """Remove what these digests alone reached, if no ref reaches them now (under the lock); a full ``collect``
        when another process changed refs since this one last looked, or the store holds damage."""
        if not self.live.current():
            self.collect()
            return
        dropped = [d for d in digests if self.live.unreferenced(d)]
        for digest in dropped:
            self._drop(digest, self.live.forget(digest))
        if dropped:
            fsync_dir(self.layout.manifests)

    def _drop(self, digest: str, unused_roots: list[str]) -> None:
        """One unreferenced digest's manifest, view and signatures, and the blobs no other live manifest names."""
        layout = self.layout
        try:
            os.unlink(layout.manifest(digest))
        except FileNotFoundError:
            pass
        self.catalog.forget(digest)
        if not (layout.partials / digest).is_dir():  # kept while a pull of its digest may still commit
            shutil.rmtree(layout.signed_by(digest), ignore_errors=True)
            try:
                os.unlink(layout.signature(digest))
            except FileNotFoundError:
                pass
        shutil.rmtree(layout.views / digest, ignore_errors=True)
        for root in unused_roots:
            try:
                os.unlink(layout.blob(root))
            except FileNotFoundError:
                pass

    def _blob_roots(self, digest: str, path: str, summarized: set[str]) -> tuple[str, ...] | None:
        """The blob names (file roots) the manifest at ``path`` lists; None when its file cannot be read as one.

        A manifest that reads whole leaves its summary in the catalog (a listing and a census then read no manifest),
        and its digest in ``summarized``.
        """
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        summary = self.catalog.summarize(digest, data)
        if summary is not None:
            summarized.add(digest)
            return summary.roots
        # Raw JSON, not the manifest's checks: collection must not depend on a manifest still validating.
        try:
            roots = tuple(f["root"] for f in json.loads(data)["files"])
        except (ValueError, KeyError, TypeError):
            return None
        return roots if all(isinstance(r, str) for r in roots) else None


def recover(layout: StoreLayout, collector: GarbageCollector, *, collect: bool = True) -> None:
    """After a crash or restart (under the lock): drop temp files and orphans, keep partials and uploads to resume.

    ``collect`` False leaves the orphans' collection (O(adapters): ~14 s at 100,000) to the caller, off its start-up.
    """
    for entry in os.scandir(layout.tmp):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)  # views are built under the lock: never live here
            continue
        if writer_alive(entry.name):
            # A temp blob is unlocked between its write and its rename into blobs/: the
            # lock alone cannot tell "abandoned" from "about to be installed".
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if try_lock(fd):  # its writer is gone
                os.unlink(entry.path)
        finally:
            os.close(fd)
    for entry in os.scandir(layout.partials):
        name = entry.name
        committed = len(name) == 64 and layout.manifest(name).is_file()
        if committed or not (Path(entry.path) / "manifest.json").is_file():
            remove_if_unheld(Path(entry.path))
    for entry in os.scandir(layout.uploads):
        if not (Path(entry.path) / "meta.json").is_file():
            remove_if_unheld(Path(entry.path))
    if collect:
        collector.collect()
