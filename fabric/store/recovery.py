"""Restart recovery and garbage collection: temp files, orphans, dead partials and uploads go; live data stays."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

from fabric.errors import IncompatibleFormat
from fabric.store.digests import DIGEST_SCHEME
from fabric.store.files import fsync_dir, remove_if_unheld, try_lock, writer_alive


_DIGEST = re.compile(r"[0-9a-f]{64}")


#: the store's on-disk format; one number with the digest scheme (format 1 = scheme 1, no ``format`` file)
STORE_FORMAT = str(DIGEST_SCHEME)


class StoreRecovery:
    """Mixed into ``AdapterStore``: runs under the store's lock."""

    def _check_format(self) -> None:
        """Refuse a store of another format by name, touching nothing in it; mark a new or empty root as ours."""
        marker = self.root / "format"
        try:
            found = marker.read_text().strip()
        except FileNotFoundError:
            found = None
        except (OSError, UnicodeDecodeError) as exc:
            raise IncompatibleFormat(f"store {self.root}: its format file is unreadable ({exc}); expected {STORE_FORMAT!r}") from None
        if found is None and (self.root / "blobs" / "sha256").is_dir():
            found = "1"
        if found is not None and found != STORE_FORMAT:
            raise IncompatibleFormat(
                f"store {self.root} is format {found[:20]!r} (digest scheme {found[:20]}); this version reads and writes format "
                f"{STORE_FORMAT} (BLAKE3 chunk trees): start this node on a new --store and re-stage or pull its adapters; "
                f"nothing in {self.root} was changed"
            )
        if found is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # Renamed into place: a crash never leaves a half-written marker; one temp name per writer (processes may race here).
            temp = self.root / f"format.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(temp, "w") as f:
                f.write(STORE_FORMAT + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, marker)
            fsync_dir(self.root)

    def _recover(self) -> None:
        """After a crash or restart (under the lock): drop temp files and orphans, keep partials to resume."""
        for entry in os.scandir(self.tmp):
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
        for entry in os.scandir(self.partials):
            name = entry.name
            committed = len(name) == 64 and self._manifest_path(name).is_file()
            if committed or not (Path(entry.path) / "manifest.json").is_file():
                remove_if_unheld(Path(entry.path))
        for entry in os.scandir(self.uploads):
            if not (Path(entry.path) / "meta.json").is_file():
                remove_if_unheld(Path(entry.path))
        self._collect()

    def _collect(self) -> None:
        """Remove manifests, views and blobs no ref reaches (under the lock).

        Damage makes it keep more, never less: while an id entry does not hold
        a digest, nothing is collected (it may point at any manifest); while a
        referenced manifest is missing or unreadable, no blob is (it may name any).
        """
        refs = self._refs()
        live = set(refs.values())
        sound_refs = all(_DIGEST.fullmatch(d) for d in live)
        keep: set[str] = set()
        blobs_known = sound_refs
        for entry in os.scandir(self.manifests):
            digest = entry.name.removesuffix(".json")
            if digest in live:
                shas = self._blob_shas(digest)
                blobs_known &= shas is not None
                keep.update(shas or ())
            elif sound_refs:
                os.unlink(entry.path)
                self._cache.pop(digest, None)
        blobs_known &= all(self._manifest_path(d).is_file() for d in live) if sound_refs else False
        for entry in os.scandir(self.signatures):
            if entry.name not in live and sound_refs and not (self.partials / entry.name).is_dir():
                os.unlink(entry.path)  # kept while a pull of its digest may still commit
        for entry in os.scandir(self.views):
            if entry.name not in live and sound_refs:
                shutil.rmtree(entry.path, ignore_errors=True)
        if blobs_known:
            for bucket in os.scandir(self.blobs):
                for blob in os.scandir(bucket.path):
                    if blob.name not in keep:
                        os.unlink(blob.path)
        fsync_dir(self.manifests)

    def _blob_shas(self, digest: str) -> list[str] | None:
        """The blob names a manifest lists; None when its file cannot be read as one."""
        # Raw JSON, not Manifest.from_json: collection must not depend on a manifest still validating.
        try:
            raw = json.loads(self._manifest_path(digest).read_bytes())
            shas = [f["root"] for f in raw["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return shas if all(isinstance(s, str) for s in shas) else None
