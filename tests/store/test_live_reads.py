"""Reads a node makes per call or per eviction round, from the store's live index instead of every ref (~0.9 s at 100,000).

A scoped caller's Fetch, GetManifest or Availability of a digest asks which ids refer to it (``ids_of``: the gate checks
the caller's verb on them); an eviction round lists every id with its digest (``held``). While no other process changed a
ref since this one last saw them, both answer from the live index; once one did, from the refs again, so its change is
seen. ``Candidates`` builds an eviction's list from ``held`` and reads what is in use once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.store import SMALL_CHUNK
from adapter_fabric.node.in_use import InUse
from adapter_fabric.node.victims import Candidates
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.catalog import Catalog
from adapter_fabric.store.eviction import IN_USE, KEPT, RESIDENT


def _refs_read(*args, **kwargs):
    raise AssertionError("every ref was read")


def test_the_ids_of_a_digest_and_an_evictions_list_read_no_ref_until_another_process_changes_one(
    tmp_path: Path, store_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    store = AdapterStore(root, chunk_size=SMALL_CHUNK)
    for adapter_id, key in (("t/a", "a"), ("t/a2", "a"), ("t/b", "b")):
        store.stage(store_adapters[key], adapter_id)
    digest_a, digest_b = store.digest_of("t/a"), store.digest_of("t/b")
    store.stage(store_adapters["c"], "t/a")  # retrained: the id whose name the manifest of digest a carries leaves it
    digest_c = store.digest_of("t/a")
    store.keep("t/b")
    sizes = {d: store.by_digest(d).total_size for d in (digest_a, digest_b, digest_c)}

    with monkeypatch.context() as patched:
        patched.setattr(Catalog, "refs", _refs_read)
        assert store.ids_of(digest_a) == ["t/a2"] and store.ids_of(digest_b) == ["t/b"] and store.ids_of("0" * 64) == []
        assert store.by_digest(digest_a).adapter_id == "t/a2"
        assert [(h.adapter_id, h.digest, h.size, h.kept) for h in store.held()] == [
            ("t/a", digest_c, sizes[digest_c], False),
            ("t/a2", digest_a, sizes[digest_a], False),
            ("t/b", digest_b, sizes[digest_b], True),
        ]
        store.unstage("t/a2")  # this process's own change keeps the index trusted
        assert store.ids_of(digest_a) == [] and [h.adapter_id for h in store.held()] == ["t/a", "t/b"]

    other = AdapterStore(root, chunk_size=SMALL_CHUNK, collect_at_open=False)  # another process sharing the store
    other.stage(store_adapters["a"], "t/a3")
    with monkeypatch.context() as patched:
        patched.setattr(Catalog, "refs", _refs_read)
        with pytest.raises(AssertionError, match="every ref was read"):
            store.ids_of(digest_a)  # the index no longer answers for refs another process changed
    assert store.ids_of(digest_a) == ["t/a3"] and store.by_digest(digest_a).adapter_id == "t/a3"
    assert [(h.adapter_id, h.digest) for h in store.held()] == [("t/a", digest_c), ("t/a3", digest_a), ("t/b", digest_b)]


def test_an_evictions_candidates_name_what_holds_each_digest(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    """Kept, resident in a slot, in use under one of its ids or as a digest, or free: read once per round."""
    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    for adapter_id, key in (("t/kept", "a"), ("t/slot", "b"), ("t/pulled", "c"), ("t/served", "a_alpha")):
        store.stage(store_adapters[key], adapter_id)
    store.stage(store_adapters["a"], "t/kept-alias")
    store.keep("t/kept")
    digests = {i: store.digest_of(i) for i in ("t/kept", "t/slot", "t/pulled", "t/served")}
    in_use = InUse()
    candidates = Candidates(store, in_use, lambda: {digests["t/slot"]})
    with in_use.hold("t/pulled"), in_use.hold(digests["t/served"]):
        held = {c.ids: c.held for c in candidates()}
    assert held == {
        ("t/kept", "t/kept-alias"): KEPT,
        ("t/slot",): RESIDENT,
        ("t/pulled",): IN_USE,
        ("t/served",): IN_USE,
    }
    assert {c.ids: c.held for c in candidates()}[("t/pulled",)] == ""  # free once its pull ended


def test_the_live_index_answers_nothing_while_a_collection_rebuilds_it(tmp_path: Path, store_adapters: dict[str, Path], monkeypatch) -> None:
    """Readers take it without the store's lock: a collection that rebuilds it (here a second one, while it was trusted)
    must not show them an index half filled, where a scoped caller's digest would have no ids and be refused."""
    from adapter_fabric.store.live_index import LiveIndex

    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    digest = store.stage(store_adapters["a"], "t/a").digest
    assert store._collector.live.ids_referring(digest) == ["t/a"]
    seen_while_filling = []
    add = LiveIndex._add
    monkeypatch.setattr(LiveIndex, "_add", lambda self, d, i: (seen_while_filling.append(self.ids_referring(digest)), add(self, d, i)))
    store.collect_garbage()
    assert seen_while_filling == [None] and store._collector.live.ids_referring(digest) == ["t/a"]
