"""The export directory: every staged adapter as a PEFT directory an inference engine can load.

``<export>/<name>/`` holds ``adapter_config.json`` and
``adapter_model.safetensors`` as hard links to the store's read-only blobs (no
copy; the export directory must be on the store's filesystem). ``<name>`` is
the adapter id with each ``/`` written ``%2F`` (``team-a/support-v3`` ->
``team-a%2Fsupport-v3``): ``%`` is outside the id alphabet, so the mapping is
reversible and never nests directories. This is the store's own ref naming.
A blob the store quarantines (``adapter_fabric.store.integrity``) takes every entry
linking to it away the same way; the entry comes back once its bytes are
committed again (a pull or a re-stage).

An entry appears atomically: it is built under a ``%tmp-`` name (never a valid
name) and renamed into place, so a reader such as vLLM's filesystem resolver
sees a whole directory or none. Unstaging removes the name the same way: the
entry is renamed aside (``%old-``) and deleted only after ``GRACE_S``, so an
engine that resolved the path just before still reads whole files. Restaging
an id with other bytes swaps the entry: the old one is renamed aside first, so
for that instant the name is absent, never half written. On start the node
re-exports every staged adapter and drops entries of ids no longer staged.

A store given an ``admit`` rule (a node with ``--trusted-signers``: only
adapters a trusted signer signed) exports only the adapters it admits, and
withdraws an entry whose adapter it does not, at start too: an engine reading
the directory loads nothing the node itself would refuse to load or serve.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.store.digests import FILE_NAMES
from adapter_fabric.store.durable import fsync_dir
from adapter_fabric.store.files import decode_id, encode_id
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import Manifest

_TEMP_PREFIX = "%tmp-"
_TRASH_PREFIX = "%old-"
#: seconds a removed entry stays readable (under its %old- name) for readers that opened it before
GRACE_S = 60.0


def export_name(adapter_id: str) -> str:
    """The directory name of an adapter id in an export directory (``/`` -> ``%2F``)."""
    return encode_id(adapter_id)


def adapter_id_of(name: str) -> str:
    """The adapter id an export directory entry stands for (the inverse of ``export_name``; a version entry's id too)."""
    return decode_id(name.partition(VERSION_MARK)[0])


#: between an id's export name and its digest's first characters in a version entry (outside the id alphabet)
VERSION_MARK = "#"


def version_name(adapter_id: str, digest: str) -> str:
    """The export entry named by one digest of an id, ``team-a%2Fsupport#3f2a9c0d1e2f3a4b``: it never holds other bytes.

    For an engine that keys its caches by the path it loaded from (vLLM's prefix cache keys on the LoRA's name and
    path): after the id moves, the new digest comes from a new path, so no cache entry of the old bytes is reused.
    """
    return f"{export_name(adapter_id)}{VERSION_MARK}{digest[:16]}"


def check_apart(export_root: Path, store_root: Path) -> None:
    """Refuse an export directory that is the store, holds it, or lies inside it (``InvalidArgument`` naming both)."""
    export, store = export_root.resolve(), store_root.resolve()
    if export == store or store.is_relative_to(export) or export.is_relative_to(store):
        where = "is" if export == store else "holds" if store.is_relative_to(export) else "lies inside"
        raise InvalidArgument(f"--export-dir {export_root} {where} the store {store_root}: give the export directory one of its own, outside the store")


def is_export(entry: Path) -> bool:
    """Whether ``entry`` is what ``export`` makes: a directory named by an id, holding nothing but an adapter's files.

    An empty one counts (removing it loses nothing); one holding anything else is an operator's, and stays.
    """
    if entry.name.startswith("%") or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        validate_adapter_id(adapter_id_of(entry.name))
        names = list(entry.iterdir())
    except (InvalidArgument, OSError):
        return False
    return all(child.name in FILE_NAMES and child.is_file() and not child.is_symlink() for child in names)


def _is_version(entry: Path) -> bool:
    """A version entry (``version_name``) of an id, holding nothing but an adapter's files: what ``export_version`` makes."""
    name, mark, digest = entry.name.partition(VERSION_MARK)
    if not mark or len(digest) != 16 or not all(c in "0123456789abcdef" for c in digest) or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        validate_adapter_id(adapter_id_of(name))
        return all(child.name in FILE_NAMES and child.is_file() for child in entry.iterdir())
    except (InvalidArgument, OSError):
        return False


class ExportDir:
    """Keeps ``root`` in step with a store: one PEFT directory per staged id, hard links into ``blob_path(root)``."""

    def __init__(
        self, root: Path | str, blob_path: Callable[[str], Path], probe: Path, store_root: Path, admit: Callable[[Manifest], bool] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``probe``: any file in the store, linked once to prove ``root`` is on the same filesystem.

        ``admit``: which adapters may be exported (None: every one); an entry of one it refuses is withdrawn.
        ``on_change``: called (under the store's lock: it must only wake someone) after an entry appeared, changed or went.

        ``root`` must not overlap ``store_root`` (be it, hold it, or lie in it): the export directory removes entries of
        ids no longer staged, and the store's own directories would be among them.
        """
        self.root = Path(root)
        self.on_change = on_change
        check_apart(self.root, store_root)
        self._blob_path = blob_path
        self._admit = admit
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in (*self.root.glob(f"{_TEMP_PREFIX}*"), *self.root.glob(f"{_TRASH_PREFIX}*")):  # of a node that died mid-swap
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        test = self.root / f"{_TEMP_PREFIX}probe-{secrets.token_hex(4)}"
        try:
            os.link(probe, test)
        except OSError as exc:
            hint = "it must be on the same filesystem as --store (entries are hard links)" if exc.errno == errno.EXDEV else exc.strerror
            raise InvalidArgument(f"cannot export adapters into {self.root}: {hint}") from None
        test.unlink()

    def path_of(self, adapter_id: str) -> Path:
        """Where an adapter id's PEFT directory is (whether or not it is there)."""
        return self.root / export_name(adapter_id)

    def export(self, adapter_id: str, manifest: Manifest) -> Path | None:
        """Make ``<root>/<name>/`` hold ``manifest``'s files (a no-op when it already does); None, and no entry, when not admitted."""
        dest = self.path_of(adapter_id)
        if self._admit is not None and not self._admit(manifest):
            if dest.exists():
                self.remove(adapter_id)
            return None
        if self._holds(dest, manifest):
            return dest
        self._place(dest, manifest)
        self._drop_versions(adapter_id, keep=manifest.digest)
        fsync_dir(self.root)
        self._changed()
        return dest

    def export_version(self, adapter_id: str, manifest: Manifest) -> Path:
        """``<root>/<version_name>/`` holding ``manifest``'s files (made once; dropped when the id moves or goes)."""
        dest = self.root / version_name(adapter_id, manifest.digest)
        if not self._holds(dest, manifest):
            self._place(dest, manifest)
            fsync_dir(self.root)
        return dest

    def _place(self, dest: Path, manifest: Manifest) -> None:
        """Build ``manifest``'s links under a temporary name, then rename them over ``dest`` in one step (the old one set aside)."""
        building = self.root / f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
        building.mkdir()
        try:
            for entry in manifest.files:
                os.link(self._blob_path(entry.root), building / entry.name)
            fsync_dir(building)
            self._set_aside(dest)
            os.rename(building, dest)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    def _drop_versions(self, adapter_id: str, keep: str | None) -> None:
        """Set aside the version entries of ``adapter_id`` but ``keep``'s (None: all of them)."""
        kept = version_name(adapter_id, keep) if keep is not None else None
        for entry in self.root.glob(f"{export_name(adapter_id)}{VERSION_MARK}*"):
            if entry.name != kept:
                self._set_aside(entry)

    def remove(self, adapter_id: str) -> None:
        """Take an id's directory away in one step (renamed aside, then deleted), and its version entries."""
        self._set_aside(self.path_of(adapter_id))
        self._drop_versions(adapter_id, keep=None)
        fsync_dir(self.root)
        self._changed()

    def withdraw(self, blob: os.stat_result) -> list[str]:
        """Remove, each in one step as ``remove`` does, every entry holding a hard link to ``blob``; the ids removed.

        A quarantined blob's links here share its corrupt inode: an engine reading them would load the corrupt bytes.
        """
        removed = []
        for entry in self.root.iterdir():
            if entry.name.startswith("%"):
                continue
            try:
                linked = any(os.path.samestat(os.stat(f), blob) for f in entry.iterdir())
            except OSError:  # not a directory, or removed meanwhile
                continue
            if linked:
                self._set_aside(entry)
                removed.append(adapter_id_of(entry.name))
        if removed:
            fsync_dir(self.root)
            self._changed()
        return removed

    def sync(self, staged: Iterable[Manifest]) -> None:
        """Export every staged manifest and remove entries of ids that are not staged (at node start)."""
        keep: set[str] = set()
        for manifest in staged:
            if (dest := self.export(manifest.adapter_id, manifest)) is not None:
                keep.update((dest.name, version_name(manifest.adapter_id, manifest.digest)))
        for entry in self.root.iterdir():
            if entry.name not in keep and (is_export(entry) or _is_version(entry)):  # an operator's own files here are never touched
                self._set_aside(entry)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _holds(self, dest: Path, manifest: Manifest) -> bool:
        try:
            return all(os.path.samefile(dest / e.name, self._blob_path(e.root)) for e in manifest.files)
        except OSError:
            return False

    def _set_aside(self, dest: Path) -> None:
        """Take ``dest``'s name away at once; its files go after GRACE_S (a reader may hold the directory)."""
        try:
            os.rename(dest, self.root / f"{_TRASH_PREFIX}{time.time_ns()}-{secrets.token_hex(4)}")
        except FileNotFoundError:
            pass
        for old in self.root.glob(f"{_TRASH_PREFIX}*"):
            born = int(old.name[len(_TRASH_PREFIX) :].split("-")[0])
            if time.time_ns() - born > GRACE_S * 1e9:
                shutil.rmtree(old, ignore_errors=True)
