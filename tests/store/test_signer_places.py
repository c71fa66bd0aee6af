"""Issue 28 (6), in the store alone: a digest's signer places (adapter_fabric.store.signatures) are bounded per principal,
go with the last id that brought them, and always make room for a signer the node trusts."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_fabric.errors import TooManySigners
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.signatures import MAX_SIGNERS_PER_PRINCIPAL
from adapter_fabric.trust.signing import MAX_SIGNERS, keygen, sign
from tests.support.store import snapshot


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("signers"), build_tiny_model()
    return {n: make_peft_adapter(root / n, base_model=base, r=4, target_modules=["q_proj", "v_proj"], seed=s) for s, n in ((81, "x"), (82, "y"))}


def signed_by(digest: str, count: int):
    return [sign(keygen()[0], digest) for _ in range(count)]


def test_one_principal_takes_at_most_its_places_and_nothing_changes_when_refused(tmp_path, adapters) -> None:
    store = AdapterStore(tmp_path / "s")
    digest = store.stage(adapters["x"], "mallory/1").digest
    keys = signed_by(digest, MAX_SIGNERS_PER_PRINCIPAL + 1)
    for signed in keys[:MAX_SIGNERS_PER_PRINCIPAL]:
        assert store.add_signature(digest, signed, adapter_id="mallory/1", principal="mallory")
    before = snapshot(store.root)
    with pytest.raises(TooManySigners, match="principal 'mallory' holds 2"):
        store.add_signature(digest, keys[-1], adapter_id="mallory/1", principal="mallory")
    assert snapshot(store.root) == before
    assert store.add_signature(digest, keys[-1], adapter_id="mallory/1", principal="team-a")  # another principal's place
    assert store.add_signature(digest, signed_by(digest, 1)[0], adapter_id="mallory/1")  # an unbounded caller (an operator)
    assert len(store.signatures_of(digest)) == MAX_SIGNERS_PER_PRINCIPAL + 2


def test_a_place_goes_with_the_last_id_that_brought_it(tmp_path, adapters) -> None:
    store = AdapterStore(tmp_path / "s")
    digest = store.stage(adapters["x"], "a/1").digest
    store.stage(adapters["x"], "a/2")
    store.stage(adapters["x"], "b/1")
    [mine, theirs] = signed_by(digest, 2)
    store.add_signature(digest, mine, adapter_id="a/1", principal="a")
    store.add_signature(digest, mine, adapter_id="a/2", principal="a")  # the same signer brought by a second id
    store.add_signature(digest, theirs, adapter_id="b/1", principal="b")
    store.unstage("a/1")
    assert {s.public_key for s in store.signatures_of(digest)} == {mine.public_key, theirs.public_key}
    store.stage(adapters["y"], "a/2")  # a restage elsewhere: a/2 no longer names the digest
    assert {s.public_key for s in store.signatures_of(digest)} == {theirs.public_key}
    assert store.signer_places(digest, "a") == 0
    store.add_signature(digest, signed_by(digest, 1)[0], adapter_id="b/1", principal="b")  # the next change removes the file
    assert mine.signer not in {p.name for p in store._layout.signed_by(digest).iterdir()}


def test_a_trusted_signer_takes_the_place_of_an_untrusted_one(tmp_path, adapters) -> None:
    store = AdapterStore(tmp_path / "s")
    digest = store.stage(adapters["x"], "x").digest
    junk = signed_by(digest, MAX_SIGNERS)
    for i, signed in enumerate(junk):
        store.add_signature(digest, signed, adapter_id="x", principal=f"p{i // 2}")
    [author] = signed_by(digest, 1)
    with pytest.raises(TooManySigners, match="the most a store keeps"):
        store.add_signature(digest, author, adapter_id="x")
    trusted = lambda s: s.public_key == author.public_key  # noqa: E731
    assert store.add_signature(digest, author, adapter_id="x", trusted=trusted)
    held = {s.public_key for s in store.signatures_of(digest)}
    assert len(held) == MAX_SIGNERS and author.public_key in held
