"""The on-disk, content-addressed adapter store: a facade over collaborators that each own one concept.

Built by composition, bottom up (each is handed what it needs, none holds the store)::

    StoreLayout        paths (adapter_fabric.store.layout; the on-disk layout is documented there)
    StoreLock          flock around every metadata change; TempFiles: durable writes (adapter_fabric.store.durable)
    Catalog            reads refs and manifests (adapter_fabric.store.catalog)
    Quota              limits and usage; at the limit a writer is refused (StoreFull), never blocked (adapter_fabric.store.quota)
    GarbageCollector   what no ref reaches goes; recover() after a restart (adapter_fabric.store.recovery)
    Committer          the one commit path: blobs, manifest, ref, in order, under the lock (adapter_fabric.store.committer)
    Integrity          verified reads, quarantine, damage, scrub (adapter_fabric.store.integrity)
    ExportDir          PEFT directories for engines, kept in step through the committer's listener (adapter_fabric.store.export)
    DirectoryStager, Uploads, Partials   the three writers; each hands verified temp files to the committer
    Signatures         the authors' signatures kept beside a digest, one per signer, verified first (adapter_fabric.store.signatures)
    Recency, KeptIds   when each id was last used, and the ids an operator kept, for an evicting store (adapter_fabric.store.keeping)

Concurrency: threads and processes may share a root. Metadata changes hold
the store's flock. A partial or upload is held by one open object at a time
(``flock`` on its own lock file); inside one store object, opening it again
returns the same object.
"""

from __future__ import annotations

import builtins
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.errors import AdapterNotFound
from adapter_fabric.format.safetensors_index import MAX_HEADER_BYTES
from adapter_fabric.store.catalog import Catalog, Listed
from adapter_fabric.store.census import Census
from adapter_fabric.store.commit_events import CommitEvents
from adapter_fabric.store.committer import Committer
from adapter_fabric.store.durable import TempFiles, fsync_dir
from adapter_fabric.store.export import ExportDir
from adapter_fabric.store.format_marker import claim_format
from adapter_fabric.store.held import HeldAdapter, list_held
from adapter_fabric.store.hygiene import Leftover, expire_abandoned, leftovers
from adapter_fabric.store.ids import validate_adapter_id, validate_digest
from adapter_fabric.store.integrity import DamagedEntry, DamageListener, Integrity
from adapter_fabric.store.keeping import KeptIds, Recency
from adapter_fabric.store.layout import StoreLayout
from adapter_fabric.store.manifest import CONFIG_FILE, DEFAULT_CHUNK_SIZE, WEIGHTS_FILE, FileEntry, Manifest
from adapter_fabric.store.partial import PartialDownload, Partials
from adapter_fabric.store.quota import Quota
from adapter_fabric.store.recovery import GarbageCollector, recover
from adapter_fabric.store.signatures import Signatures
from adapter_fabric.store.staging import DirectoryStager
from adapter_fabric.store.store_lock import StoreLock
from adapter_fabric.store.tenant_holdings import TenantHoldings
from adapter_fabric.store.tenants import TenantLimits, TenantQuotas, TenantUsage
from adapter_fabric.store.upload import Upload, Uploads
from adapter_fabric.trust.signing import Signed, TrustedSigners


class AdapterStore:
    """Adapters staged by id, stored by content, committed atomically, safe across restarts."""

    def __init__(
        self,
        root: Path | str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_bytes: int | None = None,
        max_adapter_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        export_dir: Path | str | None = None,
        trusted: TrustedSigners | None = None,
        tenant_quotas: tuple[TenantLimits, ...] = (),
        collect_at_open: bool = True,
        on_export_change: Callable[[], None] | None = None,
        on_damage: DamageListener | None = None,
    ) -> None:
        """``export_dir``: keep every staged adapter there as a PEFT directory of hard links (``adapter_fabric.store.export``).

        ``trusted``: export only adapters one of these signers signed (a trusting node's engine loads nothing it refuses).

        At ``max_bytes`` a writer is refused (``StoreFull``) before a byte is written: the store never drops anything on its own
        (an evicting node makes room outside the store's locks, ``adapter_fabric.node.eviction``).
        ``tenant_quotas``: bytes and id counts per id prefix, beside ``max_bytes`` (``adapter_fabric.store.tenants``).
        ``collect_at_open``: False leaves what no ref reaches to ``collect_garbage`` (a node calls it once serving).
        ``on_export_change``: called after an export entry appeared, changed or went (under the store's lock: it only wakes
        someone, as a driven engine's reconcile). ``on_damage(adapter_id, digest, error)``: told of damage a verified read
        finds (a node queues a repair).
        """
        self.root = Path(root)
        self.chunk_size = chunk_size
        self._layout = StoreLayout(self.root)
        claim_format(self._layout)
        self._layout.create()
        self._lock = StoreLock(self._layout.lock)
        self._catalog = Catalog(self._layout)
        self._quota = Quota(self._layout, max_bytes, max_adapter_bytes, max_header_bytes)
        self._collector = collector = GarbageCollector(self._layout, self._catalog)
        # before the exports (a trusting one reads them); a place holds while an id that brought it names its digest
        self._signatures = Signatures(self._layout, self._lock, TempFiles(self._layout.tmp), ref_of=self._catalog.read_ref)
        with self._lock.held():
            recover(self._layout, collector, collect=collect_at_open)
            #: the export directory, when the store keeps one
            self._exports = (
                ExportDir(export_dir, self._layout.blob, self._layout.lock, self.root, self._admit_for(trusted), on_export_change)
                if export_dir is not None
                else None
            )
            self._integrity = Integrity(self._layout, self._catalog, self._lock, self._exports, on_damage)
            if self._exports is not None:
                # Only whole adapters: a blob quarantined before the restart has nothing to link to.
                self._exports.sync(m for m in self._catalog.each() if self._catalog.complete(m.digest) is not None)
        #: when each id was last used (its ref's stamp, ``adapter_fabric.store.keeping``)
        self._recency = Recency(self._layout)
        #: the sound and damaged ids, kept between StoreStatus calls (``adapter_fabric.store.census``)
        self._census = Census(self._layout, self._catalog, collector.live.generation)
        holdings = TenantHoldings(self._catalog, collector.live)
        self._committer = Committer(
            self._layout, self._lock, TempFiles(self._layout.tmp), self._catalog, collector, self._quota,
            CommitEvents(self._catalog, self._integrity, self._exports, self._recency, self._census, holdings),
        )
        #: per-tenant quotas and the room open writers reserved of them
        self._tenants = TenantQuotas(self._catalog, tuple(tenant_quotas), holdings=holdings)
        self._partials = Partials(self._catalog, self._committer, self._quota, self._tenants)
        self._uploads = Uploads(self._committer, self._quota, self._tenants, chunk_size)
        self._stager = DirectoryStager(self._catalog, self._committer, self._quota, self._tenants, chunk_size)
        #: which ids an operator kept (``adapter_fabric.store.keeping``)
        self._kept = KeptIds(self._layout)

    # ------------------------------------------------------------ limits

    @property
    def max_bytes(self) -> int | None:
        """The whole store's limit in bytes (None: no limit)."""
        return self._quota.max_bytes

    @property
    def max_adapter_bytes(self) -> int | None:
        """The largest adapter accepted from a client or a peer (None: no limit)."""
        return self._quota.max_adapter_bytes

    @property
    def max_header_bytes(self) -> int:
        """The largest safetensors header parsed or accepted."""
        return self._quota.max_header_bytes

    def usage(self) -> int:
        """Bytes held: committed blobs, every partial at its full size, uploads written plus what open ones reserved."""
        return self._quota.usage()

    def tenant_usage(self) -> builtins.list[TenantUsage]:
        """Each per-tenant quota with what its prefix holds (committed and reserved); one entry per quota."""
        return self._tenants.usage()

    def set_tenant_quotas(self, quotas: tuple[TenantLimits, ...]) -> None:
        """Replace the per-tenant quotas (a policy reload); writers already open keep what they reserved."""
        self._tenants.set_quotas(tuple(quotas))

    # ------------------------------------------------------------ reading

    def get(self, adapter_id: str) -> Manifest:
        """The committed manifest of an id (``AdapterNotFound`` naming the id)."""
        return self._catalog.get(adapter_id)

    def by_digest(self, digest: str) -> Manifest | None:
        """The committed manifest of a digest, under one of the ids referring to it; None if absent."""
        return self._catalog.by_digest(digest, self._referring)

    def list(self) -> builtins.list[Manifest]:
        """Every committed adapter whose manifest reads, sorted by id (partials and uploads are never listed).

        A damaged entry is left out here, never failing the whole list: ``damaged()`` names it.
        """
        return self._catalog.list()

    def page(self, after: str, count: int, keep: Callable[[str], bool] | None = None) -> builtins.list[Listed]:
        """Up to ``count`` staged ids sorted after ``after`` ("" = the first), each with its manifest or, when damaged, its problem.

        Reads only the page's entries: a paged listing stays bounded however many adapters the store holds.
        ``keep``: list only the ids it answers true for (those a caller may read), before the page is cut.
        """
        return self._catalog.page(after, count, keep)

    def blob_path(self, root: str) -> Path:
        """The path of a committed file by its root (for Fetch serving and loading)."""
        validate_digest(root, "file root")
        path = self._layout.blob(root)
        if not path.is_file():
            raise AdapterNotFound(f"no committed file with root {root} in this store")
        return path

    def verified_blob(self, manifest: Manifest, entry: FileEntry, *, force: bool = False) -> Path:
        """The path of ``entry``'s committed blob, its bytes verified since they were last written (``adapter_fabric.store.integrity``)."""
        return self._integrity.verified_blob(manifest, entry, force=force)

    def verified_weights(self, manifest: Manifest) -> Path:
        """``verified_blob`` of the weights file (what a promote maps and a Fetch serves)."""
        return self._integrity.verified_weights(manifest)

    def verify(self, adapter_id: str) -> Manifest:
        """Re-read an adapter's committed files, every chunk against its manifest; ``IntegrityError`` (and quarantine) on any difference."""
        manifest = self.get(adapter_id)
        for entry in manifest.files:
            self._integrity.verified_blob(manifest, entry, force=True)
        return manifest

    def file_sha256(self, manifest: Manifest) -> dict[str, str]:
        """Each file's whole-file sha256 (hex, by file name), for comparing with a model hub's listing."""
        return self._integrity.file_sha256(manifest)

    def damaged(self) -> builtins.list[DamagedEntry]:
        """Every id whose entry, manifest or blobs cannot be used as they are (sorted by id); [] for a sound store."""
        return self.census()[1]

    def held(self) -> builtins.list[HeldAdapter]:
        """Every staged id with its digest, that adapter's size, its last use and whether it is kept, sorted by id; damaged ones
        left out (``adapter_fabric.store.held``: no manifest, and while the live index is trusted no ref, read per id)."""
        return list_held(self._catalog, self._collector.live, self._recency, self._kept)

    def collect_garbage(self) -> None:
        """Remove what no ref reaches (a crash's orphans) and build the index later collections use and the census StoreStatus
        reads, then read every ref's recency stamp (outside the lock: a clock stepped back since they were written); O(adapters)."""
        with self._lock.held():
            collected = self._collector.collect()
            self._census.take(collected.refs, collected.whole)  # from what the collection read: no file read again
        self._recency.saw(max(self._catalog.stamps().values(), default=0))  # the next stamp goes past every ref's

    def damaged_at(self, adapter_id: str, digest: str) -> bool:
        """Whether ``adapter_id`` still names ``digest`` and some of that digest's bytes are missing or quarantined."""
        return self._catalog.read_ref(adapter_id) == digest and self._catalog.complete(digest) is None

    def export_version(self, adapter_id: str, manifest: Manifest) -> Path | None:
        """A version entry of ``adapter_id`` in the export directory, named by its digest (``ExportDir.export_version``);
        None when the store keeps no export directory."""
        return self._exports.export_version(adapter_id, manifest) if self._exports is not None else None

    def digest_of(self, adapter_id: str) -> str | None:
        """The digest ``adapter_id`` names now (its ref, no manifest read); None when it is not staged."""
        return self._catalog.read_ref(adapter_id)

    def touch(self, adapter_id: str) -> None:
        """``adapter_id`` was used now (promoted, pulled, served): an eviction keeps it longer. Survives restarts (its ref's mtime)."""
        self._recency.touch(adapter_id)

    def keep(self, adapter_id: str, kept: bool = True) -> None:
        """An operator's keep: a kept id is never evicted (``False`` undoes it). Survives restarts."""
        self._kept.set(adapter_id, kept)

    def is_kept(self, adapter_id: str) -> bool:
        """Whether an operator kept ``adapter_id`` (``keep``)."""
        return adapter_id in self._kept

    def kept_count(self) -> int:
        """How many ids an operator kept."""
        return self._kept.count()

    def leftovers(self, now: float | None = None) -> builtins.list[Leftover]:
        """The uploads and partial downloads kept on disk for a resume, oldest first (``adapter_fabric.store.hygiene``)."""
        return leftovers(self._layout, now)

    def expire_abandoned(self, max_age_seconds: float, now: float | None = None) -> builtins.list[Leftover]:
        """Remove the uploads and partials untouched for ``max_age_seconds`` and held by no writer; what went."""
        return expire_abandoned(self._layout, self._lock, max_age_seconds, now)

    def census(self) -> tuple[builtins.list[str], builtins.list[DamagedEntry]]:
        """Every id: the sound ones and the damaged ones, each sorted by id (kept between calls: ``adapter_fabric.store.census``)."""
        sound, damaged = self._census.read()
        return sound, [DamagedEntry(*entry) for entry in damaged]

    def scrub(self, rate: int = 0, stop: threading.Event | None = None, on_damage=None) -> int:
        """Re-read and verify every committed blob at most ``rate`` bytes/s; the count of damaged adapters (``Integrity.scrub``)."""
        return self._integrity.scrub(rate, stop, on_damage)

    def materialize(self, adapter_id: str) -> Path:
        """A directory with adapter_config.json and adapter_model.safetensors (hard links into blobs) PEFT can load."""
        manifest = self.get(adapter_id)
        view = self._layout.views / manifest.digest
        with self._lock.held():
            if self._catalog.read_ref(adapter_id) != manifest.digest:
                raise AdapterNotFound(f"adapter {adapter_id!r} was unstaged or restaged while being materialized")
            if (view / CONFIG_FILE).is_file() and (view / WEIGHTS_FILE).is_file():
                return view
            shutil.rmtree(view, ignore_errors=True)
            building = self._layout.tmp / f"view-{secrets.token_hex(8)}"
            building.mkdir()
            for entry in manifest.files:
                os.link(self._integrity.verified_blob(manifest, entry), building / entry.name)
            os.rename(building, view)
            fsync_dir(self._layout.views)
        return view

    # ------------------------------------------------------------ writing

    def check_present(self) -> None:
        """``StoreMissing`` when the store (or a core part of it) was deleted under this process: called before a writer opens, so a write never recreates parts of a deleted store, and after an unexpected missing file, to say why."""
        self._catalog.check_present()

    def stage(self, directory: Path | str, adapter_id: str, check: Callable[[Manifest], None] | None = None) -> Manifest:
        """Copy a PEFT adapter directory in under ``adapter_id``; everything is checked before a byte is written (``check`` too)."""
        self.check_present()
        return self._stager.stage(directory, adapter_id, check)

    def unstage(self, adapter_id: str) -> bool:
        """Remove an id; True when its bytes were removed too (no other id refers to its digest)."""
        validate_adapter_id(adapter_id)
        digest = self._committer.remove_ref(adapter_id)
        if digest is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged in this store")
        self._kept.set(adapter_id, False)  # a kept id unstaged by hand is kept no more
        return not self._layout.manifest(digest).exists()

    def evict(self, adapter_id: str, digest: str) -> bool:
        """Unstage ``adapter_id`` if it still names ``digest`` (an eviction's victim, chosen a moment ago); True when it did."""
        return self._committer.remove_ref(adapter_id, only_digest=digest) is not None

    def open_partial(self, manifest: Manifest) -> PartialDownload:
        """The download of ``manifest``'s weights, keyed by digest; resumes what an earlier one left verified."""
        self.check_present()
        return self._partials.open(manifest)

    def refer(self, manifest: Manifest) -> Manifest:
        """``manifest.adapter_id`` pointed at its digest's bytes committed here already; ``AdapterNotFound`` when they left."""
        return self._partials.refer(manifest)

    def partial_for(self, digest: str) -> PartialDownload | None:
        """The download of ``digest`` open in this store object, if any."""
        return self._partials.find(digest)

    def arriving(self, digest: str) -> bool:
        """Whether bytes of a download of ``digest`` are here: one open now, or one left to resume."""
        return self._partials.find(digest) is not None or bool(self._partials.left_for(digest))

    def ids_of(self, digest: str) -> builtins.list[str]:
        """The ids referring to ``digest`` here: committed ones (sorted), then the one a download of it (open, or left to
        resume) is for."""
        ids = self._referring(digest)
        partial = self._partials.find(digest)
        arriving = partial.manifest.adapter_id if partial is not None else self._partials.left_for(digest)
        return ids + [arriving] if arriving and arriving not in ids else ids

    def _referring(self, digest: str) -> builtins.list[str]:
        """The committed ids referring to ``digest``, sorted: from the live index while no other process changed a ref
        (a scoped caller's Fetch or Availability asks per call), else from every ref (~0.9 s at 100,000)."""
        ids = self._collector.live.ids_referring(digest)
        return ids if ids is not None else self._catalog.ids_referring(digest)

    def upload_offset(self, adapter_id: str, blake3: str) -> int:
        """Bytes of an interrupted upload of (id, whole-file BLAKE3) kept here; 0 when none."""
        return self._uploads.offset(adapter_id, blake3)

    def open_upload(self, adapter_id: str, config_json: bytes, size: int, blake3: str, weights_root: str) -> Upload:
        """A client upload of a safetensors file; reopening the same (id, whole-file BLAKE3) continues at its offset."""
        self.check_present()
        return self._uploads.open(adapter_id, config_json, size, blake3, weights_root)

    def signatures_of(self, digest: str) -> tuple[Signed, ...]:
        """Every signature kept for ``digest`` (none when unsigned), each verified under its signer's key."""
        return self._signatures.get(digest)

    def signer_places(self, digest: str, principal: str) -> int:
        """The signer places of ``digest`` that ``principal`` holds now (``store.signatures``)."""
        return self._signatures.held_by(digest, principal)

    def add_signature(
        self, digest: str, signed: Signed, *, adapter_id: str = "", principal: str | None = None, trusted: Callable[[Signed], bool] | None = None
    ) -> bool:
        """Keep one signer's signature of ``digest`` once it verifies (``BadSignature``, ``TooManySigners``); True when new.

        ``adapter_id`` brought it (its place goes with the last such id), ``principal`` took the place (bounded per principal;
        None: not bounded), ``trusted`` says which signatures always get a place (``adapter_fabric.store.signatures``).
        A new signature may admit the digest's ids to the export directory (a trusting store's): they are exported now.
        """
        added = self._signatures.add(digest, signed, adapter_id=adapter_id, principal=principal, trusted=trusted)
        if added and self._exports is not None:
            with self._lock.held():
                manifest = self._catalog.complete(digest)
                for adapter_id, ref in sorted(self._catalog.refs().items()):
                    if ref == digest and manifest is not None:
                        self._exports.export(adapter_id, manifest.with_id(adapter_id))
        return added

    def _admit_for(self, trusted: TrustedSigners | None):
        """The export directory's rule: every adapter, or (trusting signers) those a trusted signer signed."""
        if trusted is None or not trusted.required:
            return None
        return lambda manifest: trusted.trusts(manifest.digest, self._signatures.get(manifest.digest))

