"""What follows each commit and removal, told by the committer under the store's lock (its ``CommitListener``)."""

from __future__ import annotations

from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.census import Census
from adapter_fabric.store.export import ExportDir
from adapter_fabric.store.integrity import Integrity
from adapter_fabric.store.keeping import Recency
from adapter_fabric.store.tenant_holdings import TenantHoldings


class CommitEvents:
    """What follows a commit: integrity stamps, the export directory, the listing's sorted ids, the census and the tenants'
    holdings kept in step (called under the store's lock)."""

    def __init__(
        self, catalog: Catalog, integrity: Integrity, exports: ExportDir | None, recency: Recency, census: Census, holdings: TenantHoldings,
    ) -> None:  # fmt: skip
        self._holdings = holdings
        self._catalog = catalog
        self._integrity = integrity
        self._exports = exports
        self._recency = recency
        self._census = census

    def changing(self) -> None:
        self._census.changing()

    def changed(self, whole: bool) -> None:
        self._census.changed(whole)

    def blob_committed(self, root: str) -> None:
        self._integrity.blob_committed(root)

    def ref_set(self, adapter_id: str, digest: str) -> None:
        self._catalog.index.ref_set(adapter_id)
        self._census.ref_set(adapter_id, digest)
        self._holdings.ref_set(adapter_id, digest)
        self._recency.touch(adapter_id)  # its stamp, past every other (the file's own mtime is the wall clock's)
        if self._exports is None:
            return  # no manifest read on a commit that exports nothing
        manifest = self._catalog.load_manifest(digest)
        if manifest is not None:  # every commit path (stage, upload, pull) ends here
            self._exports.export(adapter_id, manifest)
        self._integrity.restore_exports()  # a commit may have brought a quarantined blob back

    def ref_removed(self, adapter_id: str) -> None:
        self._catalog.index.ref_removed(adapter_id)
        self._census.ref_removed(adapter_id)
        self._holdings.ref_removed(adapter_id)
        if self._exports is not None:
            self._exports.remove(adapter_id)
