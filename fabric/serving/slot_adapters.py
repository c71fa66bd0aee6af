"""``PoolAdapters``: the ``ModelAdapters`` operations over a ``SlotPool``, with no forward.

Loading an adapter is split in two (docs/ARCHITECTURE.md invariant 7):

* ``prepare`` runs off every lock: validate the config, the safetensors header
  and every tensor's module, rank and shape against the pool, derive the
  content id, and stage the tensors as one host slot row (pinned on CUDA). Any
  refusal happens here, before a slot is touched.
* ``commit`` runs at the quiescent point under the model lock (no forward is
  running): choose the victim, overwrite the whole slot row (zeroing included),
  set scaling, name and id, make it active and most recently used. It does no
  I/O: a memory copy only.

``prepare`` reads an untrusted directory (a private snapshot, hashed for the
content id: its BLAKE3 chunk root at the default chunk size, ``adapter_fabric.store.digests``);
``prepare_verified`` loads a store blob whose bytes were verified against a
manifest, taking the root and content id from it instead of hashing again. Both load tensors as views into the file's bytes, so staging
is the only copy.

``MultiLoraModel`` (``adapter_fabric.serving.multi_lora``) adds a transformers model on top;
``ShapeOnlyModel`` (``adapter_fabric.serving.shape_only``) is a pool with a module-shape table
and no weights (benchmarks at Llama-3-8B shapes, store-and-pool checks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapter_fabric.errors import AdapterNotFound, AdaptersUnsupported, IncompatibleAdapter, IntegrityError, InvalidAdapter
from adapter_fabric.format.adapter_tensors import LoraPair, lora_pairs
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.content_id import content_id
from adapter_fabric.format.safetensors_index import parse_header
from adapter_fabric.format.tensor_file import map_immutable, read_private
from adapter_fabric.serving.adapters import ModelAdapters
from adapter_fabric.serving.pool import ACTIVE, SlotPool, StagedAdapter
from adapter_fabric.serving.row_sink import RowSink
from adapter_fabric.serving.slot_records import SlotInfo
from adapter_fabric.store.digests import DEFAULT_CHUNK_SIZE, hash_bytes
from adapter_fabric.store.ids import validate_name
from adapter_fabric.store.manifest import Manifest

SAFETENSORS_FILE = "adapter_model.safetensors"

#: ``(peer_addr, adapter_id, peft fields or None) -> local adapter directory`` (store first, then swap).
Fetcher = Callable[[str, str, Any], Path]
#: A batch row's slot: an index, -1 for the active adapter, a resident name, or None for the base model.
RowSlot = int | str | None


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, validated and staged off the lock, ready to commit."""

    name: str
    config: PeftAdapterConfig
    root: str  # the weights file's root (adapter_fabric.store.digests)
    content_id: int
    staged: StagedAdapter
    source: Path
    #: the store digest it was read from ("" for a directory's adapter): the slot keeps it
    digest: str = ""


class PoolAdapters(ModelAdapters):
    """Adapters loaded into ``pool``; ``module_names`` are every module of the (possibly weightless) model, for messages."""

    def __init__(
        self,
        pool: SlotPool,
        *,
        target_modules: Sequence[str],
        module_names: Collection[str],
        model_label: str,
        fetcher: Fetcher | None = None,
    ) -> None:
        self.pool = pool
        self.device = pool.device
        self.dtype = pool.dtype
        self.target_modules = tuple(target_modules)
        self.fetcher = fetcher
        self._module_names = frozenset(module_names)
        self._model_label = model_label
        # Held by each forward step and by each commit: commits land between steps.
        self.lock = threading.RLock()

    # ------------------------------------------------------------ ModelAdapters

    def set_active_lora(self, name: str) -> None:
        self.pool.set_active(name)

    def adapter_id_for(self, slot: int) -> int:
        return self.pool.adapter_id_for(slot)

    def acquire_adapter_slot(self, slot: int) -> int:
        return self.pool.acquire(slot)

    def release_adapter_slot(self, resolved: int) -> None:
        self.pool.release(resolved)

    def swap_lora_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        """Load into the given slot (refused if busy or pinned by another adapter); the active adapter is kept."""
        self._commit_once(self.prepare(adapter_dir, name), slot=slot, make_active=False)

    def promote_lora_from_disk(self, adapter_dir: str | Path, name: str) -> tuple[int, str | None]:
        return self._commit_once(self.prepare(adapter_dir, name))

    def promote_lora_from_peer(self, peer_addr: str, adapter_id: str, name: str, peft: Any) -> tuple[int, str | None]:
        if self.fetcher is None:
            raise AdaptersUnsupported(
                f"promote_lora_from_peer({peer_addr!r}, {adapter_id!r}): this {type(self).__name__} was built without a "
                "fetcher, so it cannot pull adapters from peers; pass fetcher= (the node supplies one)"
            )
        adapter_dir = self.fetcher(peer_addr, adapter_id, peft)  # network and store I/O: off the lock
        prepared = self.prepare(adapter_dir, name)
        if peft is not None:
            from adapter_fabric.format.peft_fields import check_agrees

            try:
                check_agrees(peft, prepared.config, adapter_id)
            except BaseException:
                self.pool.recycle(prepared.staged)
                raise
        return self._commit_once(prepared)

    # ------------------------------------------------------------ prepare / commit

    def prepare(self, adapter_dir: str | Path, name: str) -> PreparedAdapter:
        """Read, validate and stage an adapter directory; touches no slot and takes no lock."""
        _check_name(name)
        adapter_dir = Path(adapter_dir)
        config = PeftAdapterConfig.from_dir(adapter_dir)
        path = adapter_dir / SAFETENSORS_FILE
        try:
            data = read_private(path)  # a snapshot: the bytes hashed are the bytes validated and loaded
        except FileNotFoundError:
            raise InvalidAdapter(f"{path} does not exist: a PEFT adapter directory holds {SAFETENSORS_FILE}") from None
        index = parse_header(data, len(data))
        pairs = lora_pairs(index, config)
        staged = self._stage(data, index, pairs, config)
        # BLAKE3 at several GB/s per core, inline: on a helper thread it measured no faster (the header checks hold the GIL).
        digest = hash_bytes(SAFETENSORS_FILE, data, DEFAULT_CHUNK_SIZE).root
        return PreparedAdapter(name, config, digest, content_id(digest, config, pairs), staged, adapter_dir)

    def prepare_verified(self, manifest: Manifest, weights_path: str | Path, name: str) -> PreparedAdapter:
        """Stage a store blob whose bytes were verified against ``manifest`` (``AdapterStore.verified_weights``).

        The config, tensor index, root and content id come from the manifest
        (``Manifest`` checks that they agree with each other); only the tensor
        bytes are read, through a memory map of the read-only blob. The size on
        disk is checked against the manifest; rehashing would repeat the
        store's verification.
        """
        _check_name(name)
        weights_path = Path(weights_path)
        config, index, pairs = manifest.config, manifest.index, manifest.pairs
        self.check_compatible(pairs)  # before any byte is read
        try:
            mapped = map_immutable(weights_path, manifest.weights.size, f"the {manifest.weights.name} of adapter {manifest.adapter_id!r} ({manifest.digest[:12]})")
        except FileNotFoundError:  # verified a moment ago: unstaged (or quarantined) since
            raise AdapterNotFound(f"adapter {manifest.adapter_id!r} left the store while it was being promoted; stage or pull it again") from None
        staged = self._stage(mapped, index, pairs, config)
        return PreparedAdapter(name, config, manifest.weights.root, manifest.content_id, staged, weights_path, manifest.digest)

    def row_sink(self, manifest: Manifest) -> RowSink | None:
        """A slot row to stage while ``manifest``'s weights are pulled (``PeerPuller.pull(sink_for=...)``); None when the
        file's layout does not allow it (``adapter_fabric.serving.row_sink``). The pull's check ran ``check_compatible`` already."""
        config, pairs = manifest.config, manifest.pairs
        return RowSink.build(self.pool, manifest.index, pairs, _scalings(config, pairs), manifest.weights.chunk_size, manifest.digest)

    def prepared_from(self, sink: RowSink, manifest: Manifest, weights_path: str | Path, name: str) -> PreparedAdapter:
        """The adapter whose row ``sink`` staged during its pull (complete, and committed to the store as ``weights_path``)."""
        _check_name(name)
        return PreparedAdapter(name, manifest.config, manifest.weights.root, manifest.content_id, sink.finish(), Path(weights_path), manifest.digest)

    def _stage(self, buffer, index, pairs: Mapping[str, LoraPair], config: PeftAdapterConfig) -> StagedAdapter:
        """Lay a whole file's tensors out as a host slot row (a ``RowSink`` fed the file as one chunk)."""
        self.check_compatible(pairs)
        if len(buffer) != index.file_size:
            raise IntegrityError(f"the safetensors bytes are {len(buffer)} long, their header describes {index.file_size}")
        sink = RowSink.build(self.pool, index, pairs, _scalings(config, pairs))
        assert sink is not None, "a whole file always lays out as a row (only a chunked pull's layout may not)"
        sink.add(0, memoryview(buffer))
        # NaN/inf anywhere (or fp32 -> fp16 overflow): one aminmax over the row, then the tensor named.
        return sink.finish()

    def commit(self, prepared: PreparedAdapter, *, slot: int | None = None, make_active: bool = True, pin: bool = False) -> tuple[int, str | None]:
        """Land a prepared adapter at the quiescent point; ``(slot, evicted_name or None)``; ``pin``: pinned too (limit checked first).

        ``prepared`` stays valid (it may be committed again); call ``recycle`` when done with it.
        """
        with self.lock:
            return self.pool.commit(
                prepared.staged, prepared.name, prepared.content_id, slot=slot, make_active=make_active, pin=pin, digest=prepared.digest
            )

    def recycle(self, prepared: PreparedAdapter) -> None:
        """Give a prepared adapter's host staging row back for reuse (saves a slot-sized allocation)."""
        self.pool.recycle(prepared.staged)

    def _commit_once(self, prepared: PreparedAdapter, **kwargs) -> tuple[int, str | None]:
        try:
            return self.commit(prepared, **kwargs)
        finally:
            self.recycle(prepared)

    def check_compatible(self, pairs: Mapping[str, LoraPair]) -> None:
        """Refuse, naming the module and numbers, an adapter this model and pool cannot hold.

        Needs only the tensor index, so a node checks a peer's manifest before any byte moves.
        """
        for pair in pairs.values():
            self._check_fits(pair.module, pair.rank, pair.in_features, pair.out_features)

    def _check_fits(self, module: str, rank: int, fan_in: int, fan_out: int) -> None:
        if module not in self.pool.module_index:
            if module not in self._module_names:
                raise IncompatibleAdapter(
                    f"module {module} does not exist in the model {self._model_label}: the adapter was made "
                    "for another architecture or size"
                )
            raise IncompatibleAdapter(
                f"module {module} is not held by the slot pool (pool target_modules: {', '.join(self.target_modules)})"
            )
        model_in, model_out = self.pool.shape_of(module)
        if (fan_in, fan_out) != (model_in, model_out):
            raise IncompatibleAdapter(
                f"module {module}: the adapter's shape (in={fan_in}, out={fan_out}) differs from the model's "
                f"linear (in={model_in}, out={model_out})"
            )
        if rank > self.pool.max_rank:
            raise IncompatibleAdapter(f"module {module}: rank {rank} is above the pool's max_rank {self.pool.max_rank}")

    # ------------------------------------------------------------ pool state

    def slots_info(self) -> list[SlotInfo]:
        return self.pool.info()

    def resident_digests(self) -> set[str]:
        """The store digests resident in a slot (``SlotPool.resident_digests``)."""
        return self.pool.resident_digests()

    def pin(self, name: str, pinned: bool) -> None:
        self.pool.pin(name, pinned)

    # ------------------------------------------------------------ sequences

    def acquire(self, slot_or_name: RowSlot) -> int:
        """Take a ref for a sequence (at prefill): the resolved slot, or -1 (base model / no active adapter)."""
        if slot_or_name is None:
            return ACTIVE
        if isinstance(slot_or_name, str):
            return self.pool.acquire_name(slot_or_name)
        return self.pool.acquire(slot_or_name)

    def release(self, resolved: int) -> None:
        self.pool.release(resolved)


def _check_name(name: str) -> None:
    validate_name(name)  # the grammar of names, "base" reserved (adapter_fabric.store.ids)


def _scalings(config: PeftAdapterConfig, pairs: Mapping[str, LoraPair]) -> dict[str, float]:
    return {module: config.scaling_for(module) for module in pairs}
