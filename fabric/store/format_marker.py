"""The store's on-disk format marker: a store of another format is refused by name and left untouched."""

from __future__ import annotations

import os
import threading

from adapter_fabric.errors import IncompatibleFormat
from adapter_fabric.store.digests import DIGEST_SCHEME
from adapter_fabric.store.durable import fsync_dir
from adapter_fabric.store.layout import StoreLayout

#: the store's on-disk format; one number with the digest scheme (format 1 = scheme 1, no ``format`` file)
STORE_FORMAT = str(DIGEST_SCHEME)


def claim_format(layout: StoreLayout) -> None:
    """Refuse a store of another format by name, touching nothing in it; mark a new or empty root as ours."""
    root, marker = layout.root, layout.format_marker
    try:
        found = marker.read_text().strip()
    except FileNotFoundError:
        found = None
    except (OSError, UnicodeDecodeError) as exc:
        raise IncompatibleFormat(f"store {root}: its format file is unreadable ({exc}); expected {STORE_FORMAT!r}") from None
    if found is None and (root / "blobs" / "sha256").is_dir():
        found = "1"
    if found is not None and found != STORE_FORMAT:
        raise IncompatibleFormat(
            f"store {root} is format {found[:20]!r} (digest scheme {found[:20]}); this version reads and writes format "
            f"{STORE_FORMAT} (BLAKE3 chunk trees): start this node on a new --store and re-stage or pull its adapters; "
            f"nothing in {root} was changed"
        )
    if found is None:
        root.mkdir(parents=True, exist_ok=True)
        # Renamed into place: a crash never leaves a half-written marker; one temp name per writer (processes may race here).
        temp = root / f"format.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(temp, "w") as f:
            f.write(STORE_FORMAT + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, marker)
        fsync_dir(root)
