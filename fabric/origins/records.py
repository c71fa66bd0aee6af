"""The revision record of each id fetched from an origin: which digest it named, from which origin and revision, checked when.

One small JSON file per id, ``<store>/origins/records/<id with / as %2F>.json``, beside the store (the store's
own refs say id -> digest; a record says where that digest came from). A record counts only while its digest
is the id's ref: an id staged by hand, pulled from a peer or unstaged since is not the origin's any more,
and the record is ignored (and dropped when next written). Records are rewritten atomically (temp file,
rename); losing one (a crash before the rename) only makes the id revalidate at its next use.

``pinned``: an ``ID@REVISION`` id: fetched once at that revision, never revalidated, never moved.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from adapter_fabric.origins.base import Revision
from adapter_fabric.store.files import decode_id, encode_id

#: largest record read (a record is a few hundred bytes; a bigger file is not ours)
MAX_RECORD_BYTES = 64 << 10


@dataclass(frozen=True)
class RevisionRecord:
    """An id's digest, the origin revision it came from, and when that was last confirmed (wall-clock seconds)."""

    digest: str
    revision: Revision
    checked_at: float
    pinned: bool = False
    #: from an origin marked #trusted: a node with --trusted-signers takes this digest unsigned
    vouched: bool = False

    def to_json(self) -> bytes:
        fields = {"digest": self.digest, "checked_at": self.checked_at, "pinned": self.pinned, "vouched": self.vouched}
        return json.dumps({**fields, **self.revision.to_dict()}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RevisionRecord:
        data = json.loads(raw)
        return cls(str(data["digest"]), Revision.from_dict(data), float(data["checked_at"]), bool(data.get("pinned", False)), bool(data.get("vouched", False)))


class RevisionRecords:
    """Every id's revision record under ``root`` (``<store>/origins``); also the scratch area fetches write into."""

    def __init__(self, root: Path) -> None:
        self.records = root / "records"
        self.incoming = root / "incoming"
        self.records.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.incoming, ignore_errors=True)  # fetches a stopped node left half done: nothing in them was staged
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, adapter_id: str) -> Path:
        return self.records / f"{encode_id(adapter_id)}.json"

    def get(self, adapter_id: str) -> RevisionRecord | None:
        """The record of ``adapter_id``, None when it has none (or it does not read)."""
        try:
            with open(self._path(adapter_id), "rb") as handle:
                return RevisionRecord.from_json(handle.read(MAX_RECORD_BYTES))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, adapter_id: str, record: RevisionRecord) -> None:
        temp = self.records / f"%tmp-{secrets.token_hex(8)}"
        temp.write_bytes(record.to_json())
        with self._lock:
            os.replace(temp, self._path(adapter_id))

    def each(self) -> Iterator[RevisionRecord]:
        """Every record that reads, one at a time (a start-up scan; O(ids from origins))."""
        for entry in os.scandir(self.records):
            if entry.name.endswith(".json") and not entry.name.startswith("%"):
                record = self.get(decode_id(entry.name[: -len(".json")]))
                if record is not None:
                    yield record

    def remove(self, adapter_id: str) -> None:
        self._path(adapter_id).unlink(missing_ok=True)

    def scratch(self) -> Path:
        """A new empty directory a fetch writes an adapter's files into (removed by the caller, or at the next start)."""
        path = self.incoming / secrets.token_hex(8)
        path.mkdir()
        return path
