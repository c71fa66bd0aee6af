"""Store limits: the size of one adapter, its header, and the bytes the whole store may hold."""

from __future__ import annotations

import os

from fabric.errors import InvalidHeader, LimitExceeded, QuotaExceeded
from fabric.store.manifest import Manifest


class StoreQuota:
    """Mixed into ``AdapterStore``: what it holds and what it may still take (needs ``blobs``, ``partials``, ``uploads``)."""

    def usage(self) -> int:
        """Bytes held: committed blobs, every partial at its full size, uploads written plus what open ones reserved."""
        total = 0
        for top in (self.blobs, self.partials, self.uploads):
            for dirpath, _, names in os.walk(top):
                for name in names:
                    try:
                        total += os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        pass
        # An open upload's reservation counts in full: what it has not written yet is on its way.
        for upload in list(self._open_uploads.values()):
            total += max(0, upload.reserved - upload.offset)
        return total

    def _missing_bytes(self, manifest: Manifest) -> int:
        return sum(f.size for f in manifest.files if not self._blob(f.root).is_file())

    def _check_adapter_size(self, size: int, what: str) -> None:
        if self.max_adapter_bytes is not None and size > self.max_adapter_bytes:
            raise LimitExceeded(
                f"{what}: the adapter is {size} bytes, over this node's limit of {self.max_adapter_bytes} (--max-adapter-bytes); nothing was written"
            )

    def _check_manifest_limits(self, manifest: Manifest) -> None:
        """A manifest (from a peer) must fit the size limits before a byte of it is fetched."""
        what = f"downloading {manifest.adapter_id!r}"
        self._check_adapter_size(sum(f.size for f in manifest.files), what)
        if manifest.header_size > self.max_header_bytes:
            raise InvalidHeader(
                f"{what}: its safetensors header is {manifest.header_size} bytes, over this node's limit of "
                f"{self.max_header_bytes} (--max-header-bytes); nothing was written"
            )

    def _check_quota(self, needed: int, what: str) -> None:
        if self.max_bytes is None or needed == 0:
            return
        used = self.usage()
        if used + needed > self.max_bytes:
            raise QuotaExceeded(
                f"{what} needs {needed} bytes but the store holds {used} of its {self.max_bytes}-byte limit "
                f"({used + needed - self.max_bytes} over); unstage adapters or raise the limit"
            )
