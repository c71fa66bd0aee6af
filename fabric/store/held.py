"""What an eviction lists: every staged id with its digest, that adapter's size, its last use and an operator's keep.

An evicting node lists this once per round, so at 100,000 ids it reads as little as it can:

- the digests from the live index (``adapter_fabric.store.live_index``) while no other process changed a ref since
  this one last saw them; else from each ref, opened and read;
- each id's recency stamp from one listing of ``refs/`` (a stat per entry, no file opened);
- which manifests are here from one listing of ``manifests/``, and the sizes from the catalog's per-digest summaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.keeping import KeptIds, Recency
from adapter_fabric.store.live_index import LiveIndex


@dataclass(frozen=True)
class HeldAdapter:
    """One staged id as an eviction sees it: its digest, that adapter's bytes, when it was last used, and an operator's keep."""

    adapter_id: str
    digest: str
    size: int
    last_used: float
    kept: bool


def list_held(catalog: Catalog, live: LiveIndex, recency: Recency, kept_ids: KeptIds) -> list[HeldAdapter]:
    """Every staged id, sorted; damaged ones and ids staged or unstaged while it read (in one listing, not the other) left out."""
    digests = live.digests()
    if digests is None:
        stamps: dict[str, int] = {}
        digests = catalog.refs(stamps)  # each ref read, its stamp from the file open
    else:
        stamps = catalog.stamps()
    recency.saw(max(stamps.values(), default=0))
    kept = kept_ids.ids()
    ids = sorted(stamps.keys() & digests.keys())
    summaries = catalog.summaries({digests[i] for i in ids})
    found = []
    for adapter_id in ids:
        digest = digests[adapter_id]
        summary = summaries.get(digest)
        if summary is not None:
            found.append(HeldAdapter(adapter_id, digest, summary.total_size, stamps[adapter_id] / 1e9, adapter_id in kept))
    return found
