"""Restart recovery and garbage collection: temp files, orphans, dead partials and uploads go; live data stays.

Both run under the store's lock (``adapter_fabric.store.committer.Committer.locked``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.durable import fsync_dir
from adapter_fabric.store.files import remove_if_unheld, try_lock, writer_alive
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.live_index import REF_GENERATION_FILE, LiveIndex

_DIGEST = re.compile(r"[0-9a-f]{64}")


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

    def collect(self) -> None:
        """Remove what no ref reaches (under the lock), and rebuild the live index from what it read.

        Damage makes it keep more, never less: while an id entry does not hold
        a digest, nothing is collected (it may point at any manifest); while a
        referenced manifest is missing or unreadable, no blob is (it may name any).
        """
        layout = self.layout
        refs = self.catalog.refs()
        live = set(refs.values())
        sound_refs = all(_DIGEST.fullmatch(d) for d in live)
        keep: set[str] = set()
        roots_of: dict[str, list[str] | None] = {}
        blobs_known = sound_refs
        for entry in os.scandir(layout.manifests):
            digest = entry.name.removesuffix(".json")
            if digest in live:
                roots = roots_of[digest] = self._blob_roots(digest)
                blobs_known &= roots is not None
                keep.update(roots or ())
            elif sound_refs:
                os.unlink(entry.path)
                self.catalog.forget(digest)
        blobs_known &= all(layout.manifest(d).is_file() for d in live) if sound_refs else False
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
        if blobs_known:
            for bucket in os.scandir(layout.blobs):
                for blob in os.scandir(bucket.path):
                    if blob.name not in keep:
                        os.unlink(blob.path)
        fsync_dir(layout.manifests)

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

    def _blob_roots(self, digest: str) -> list[str] | None:
        """The blob names (file roots) a manifest lists; None when its file cannot be read as one."""
        # Raw JSON, not Manifest.from_json: collection must not depend on a manifest still validating.
        try:
            raw = json.loads(self.layout.manifest(digest).read_bytes())
            roots = [f["root"] for f in raw["files"]]
        except (OSError, ValueError, KeyError, TypeError):
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
