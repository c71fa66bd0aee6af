"""ShapeOnlyModel and prepare_verified: the pool-only path gives the same slot bytes and ids as MultiLoraModel."""

from __future__ import annotations

import pytest
import torch

from adapter_fabric.errors import AdapterNotFound, IncompatibleAdapter, IntegrityError, InvalidArgument
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.shape_only import ShapeOnlyModel
from adapter_fabric.store import AdapterStore
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_peft_adapter(tmp_path_factory.mktemp("a") / "a", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], seed=3)


def shapes_of_tiny() -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in build_tiny_model().named_modules() if isinstance(m, torch.nn.Linear)}


def test_shape_only_stages_the_same_row_and_id_as_the_model(adapter) -> None:
    model = MultiLoraModel(build_tiny_model(), slots=2, max_rank=8, device="cpu")
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    assert shaped.pool.modules == model.pool.modules
    slot_a, _ = model.promote_lora_from_disk(adapter, "x")
    slot_b, _ = shaped.promote_lora_from_disk(adapter, "x")
    assert torch.equal(model.pool.storage[slot_a], shaped.pool.storage[slot_b])
    assert model.adapter_id_for(slot_a) == shaped.adapter_id_for(slot_b) != 0


def test_prepare_verified_equals_prepare_and_skips_nothing_it_must_check(adapter, tmp_path) -> None:
    store = AdapterStore(tmp_path / "store")
    manifest = store.stage(adapter, "a")
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    from_dir = shaped.prepare(adapter, "x")
    from_store = shaped.prepare_verified(manifest, store.blob_path(manifest.weights.root), "x")
    assert from_store.content_id == from_dir.content_id == manifest.content_id
    assert from_store.root == from_dir.root == manifest.weights.root  # both at the default chunk size
    assert torch.equal(from_store.staged.row, from_dir.staged.row)
    assert torch.equal(from_store.staged.scaling, from_dir.staged.scaling)
    # A blob whose size differs from its manifest is refused before staging.
    short = tmp_path / "short"
    short.write_bytes(store.blob_path(manifest.weights.root).read_bytes()[:-4])
    with pytest.raises(IntegrityError, match="bytes on disk"):
        shaped.prepare_verified(manifest, short, "y")
    # A pool that cannot hold the adapter refuses it, naming the module, before reading bytes.
    small = ShapeOnlyModel(shapes_of_tiny(), slots=1, max_rank=2, device="cpu", dtype=torch.float32)
    with pytest.raises(IncompatibleAdapter, match="rank 4 is above the pool's max_rank 2"):
        small.prepare_verified(manifest, store.blob_path(manifest.weights.root), "x")


def test_recycled_staging_cannot_be_committed_and_reused_rows_hold_no_old_bytes(adapter, tmp_path) -> None:
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    big = make_peft_adapter(tmp_path / "big", base_model=build_tiny_model(), r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=9)
    first = shaped.prepare(big, "big")
    shaped.recycle(first)
    with pytest.raises(InvalidArgument, match="recycled"):
        shaped.commit(first)
    # The next stage reuses that row: padding and untouched modules must be zeros again.
    fresh = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    reused, clean = shaped.prepare(adapter, "x"), fresh.prepare(adapter, "x")
    assert torch.equal(reused.staged.row, clean.staged.row)


def test_a_blob_that_left_the_store_between_verification_and_mapping_is_not_found(adapter, tmp_path) -> None:
    """An unstage racing a promote (seen in the soak): a named AdapterNotFound, not a FileNotFoundError traceback."""
    store = AdapterStore(tmp_path / "store")
    manifest = store.stage(adapter, "a")
    blob = store.verified_weights(manifest)
    store.unstage("a")
    shaped = ShapeOnlyModel(shapes_of_tiny(), slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    with pytest.raises(AdapterNotFound, match="'a' left the store while it was being promoted"):
        shaped.prepare_verified(manifest, blob, "x")
    with pytest.raises((AdapterNotFound, IntegrityError), match="'a'"):  # named either way, never a FileNotFoundError
        store.file_sha256(manifest)
