"""Staging from a PEFT directory on this machine: checked whole before a byte is written, copied while hashed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.errors import IntegrityError, InvalidAdapter
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.committer import Committer
from adapter_fabric.store.files import COPY_BLOCK, pwrite_all
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, FileHasher, Manifest, build_manifest, iter_file
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.tenants import TenantQuotas


class DirectoryStager:
    """Copies adapter directories into the store through the committer."""

    def __init__(self, catalog: Catalog, committer: Committer, quota: Quota, tenants: TenantQuotas, chunk_size: int) -> None:
        self.catalog = catalog
        self.committer = committer
        self.quota = quota
        self.tenants = tenants
        self.chunk_size = chunk_size

    def stage(self, directory: Path | str, adapter_id: str, check: Callable[[Manifest], None] | None = None) -> Manifest:
        """Copy a PEFT adapter directory in under ``adapter_id``; everything is checked before a byte is written.

        ``check`` sees the manifest before anything is committed (an origin's fetch: this node's model, a pinned digest).
        """
        validate_adapter_id(adapter_id)
        source = Path(directory)
        config_path, weights_path = source / CONFIG_FILE, source / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise InvalidAdapter(f"{path} does not exist: a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
        what = f"staging {adapter_id!r}"
        self.quota.check_adapter_size(config_path.stat().st_size + weights_path.stat().st_size, what)
        manifest = build_manifest(adapter_id, config_path.read_bytes(), weights_path, self.chunk_size, max_header_bytes=self.quota.max_header_bytes)
        if check is not None:
            check(manifest)
        # The tenant's quota first: a tenant past it never makes an evicting store drop other tenants' adapters.
        with self.tenants.reserve(adapter_id, {f.root: f.size for f in manifest.files}, what):
            if self.committer.commit_ref(manifest):
                return manifest  # the same bytes are committed already: only the ref is new
            self.quota.check_room(self.catalog.missing_bytes(manifest), what)
            sources = {manifest.files[0].root: self.committer.temps.blob(manifest.config_json)}
            try:
                sources[manifest.weights.root] = self._copy_weights(weights_path, manifest)
                self.committer.commit(manifest, adapter_id, sources, check_room=True)
            finally:
                for path in sources.values():
                    path.unlink(missing_ok=True)
        return manifest

    def _copy_weights(self, source: Path, manifest: Manifest) -> Path:
        """Copy into a temp file, hashing what was copied: the source may change after it was checked."""
        fd, path = self.committer.temps.new()
        try:
            hasher = FileHasher(manifest.weights.chunk_size)
            with open(source, "rb") as handle:
                for block in iter_file(handle, COPY_BLOCK):
                    hasher.update(block)
                    pwrite_all(fd, block, hasher.size - len(block))
            if hasher.entry(WEIGHTS_FILE) != manifest.weights:
                raise IntegrityError(f"{source} changed while being staged (its chunk digests or size differ from the checked file)")
            os.fsync(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return path
