"""``file:///path``: an adapter is ``/path/<id>/adapter_config.json`` and ``/path/<id>/adapter_model.safetensors``
(a shared mount, a training job's output directory).

Revision: the weights file's stamp (size, mtime in ns, inode); revalidation compares both files' stamps and
copies nothing when they are the ones held. The files are copied under the same bounds as any origin's (a
FUSE mount can drip too); the stager then hashes what was copied, so a file changed mid-copy is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from adapter_fabric.errors import AdapterNotFound, InvalidArgument, OriginUnavailable
from adapter_fabric.origins.base import ADAPTER_FILES, DEFAULT_TIMEOUT_S, FetchLimits, Revision
from adapter_fabric.origins.bounded import copy_to_file


def stamp(stat: os.stat_result) -> str:
    return f"{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ino}"


class DirectoryOrigin:
    """Adapters under one local directory."""

    kind = "file"

    def __init__(self, uri: str, *, trusted: bool = False, timeout: float = DEFAULT_TIMEOUT_S, label: str = "", **_: object) -> None:
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise InvalidArgument(f"origin {uri[:200]!r}: a file origin is file:///absolute/path")
        self.root = Path(path)
        self.label = label or uri
        self.trusted = trusted
        self.timeout = timeout

    def fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits) -> Revision | None:
        what = f"origin {self.label}: {adapter_id}"
        if not self.root.is_dir():
            raise OriginUnavailable(f"{what}: {self.root} is not a directory here (an unmounted volume?)")
        folder = self.root / adapter_id
        stats = {}
        for name in ADAPTER_FILES:
            try:
                stats[name] = os.stat(folder / name)
            except FileNotFoundError:
                raise AdapterNotFound(f"{what}: the origin has no {name}") from None
            except OSError as exc:
                raise OriginUnavailable(f"{what}: {name} cannot be read: {exc.strerror}") from None
        stamps = {name: stamp(stat) for name, stat in stats.items()}
        revision = stamps[ADAPTER_FILES[1]]
        if pin and pin != revision:
            raise AdapterNotFound(f"{what}: the origin no longer has revision {pin[:80]!r} (it has {revision})")
        if known is not None and not pin and all(known.validator(n) == s for n, s in stamps.items()):
            return None
        for name in ADAPTER_FILES:
            limits.check_size(name, stats[name].st_size, what)
            try:
                with open(folder / name, "rb") as handle:
                    copy_to_file(handle.read, handle.close, into / name, name, limits, what)
            except FileNotFoundError:
                raise AdapterNotFound(f"{what}: {name} went away while being read") from None
        return Revision(self.label, revision, tuple(stamps.items()))
