"""Issue 34: the store's census (what StoreStatus counts) is kept between calls, in step with this store's own commits,
and every other change is seen: a ref written by hand, a blob removed by hand, a quarantine, another store object's commit.

Real stores on disk; each census is compared with the one a fresh store object takes whole on the same root.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapter_fabric.errors import IntegrityError
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.stamps import RACY_NS
from tests.support.store import SMALL_CHUNK, flip_byte


def _census(store: AdapterStore) -> tuple[list[str], list[tuple[str, str, str]]]:
    sound, damaged = store.census()
    return sound, [(d.adapter_id, d.digest, d.problem) for d in damaged]


def _whole(root: Path) -> tuple[list[str], list[tuple[str, str, str]]]:
    return _census(AdapterStore(root, chunk_size=SMALL_CHUNK, collect_at_open=False))


def _settle(root: Path) -> None:
    """Every directory a census stamps, dated two ticks back: no change can hide in the tick of its mtime."""
    blobs = root / "blobs" / "blake3"
    old = os.stat(root / "refs").st_mtime_ns - 2 * RACY_NS
    for directory in (root / "refs", root / "manifests", root / "quarantine", blobs, *blobs.iterdir()):
        os.utime(directory, ns=(old, old))


def _weights_blob(store: AdapterStore, adapter_id: str) -> Path:
    return store.root / "blobs" / "blake3" / (root := store.get(adapter_id).weights.root)[:2] / root


def test_the_census_follows_commits_unstages_and_damage_as_a_whole_one_sees_them(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    root = tmp_path / "s"
    store = AdapterStore(root, chunk_size=SMALL_CHUNK)
    store.stage(store_adapters["a"], "t/a")
    store.stage(store_adapters["b"], "t/b")
    assert _census(store) == (["t/a", "t/b"], [])
    store.stage(store_adapters["c"], "t/c")
    store.stage(store_adapters["b"], "t/a")  # restaged: other bytes
    store.unstage("t/b")
    assert _census(store) == _whole(root) == (["t/a", "t/c"], [])
    (root / "refs" / "broken").write_text("not a digest")  # by hand, beside this store
    assert _census(store) == _whole(root)
    assert [d[0] for d in _census(store)[1]] == ["broken"]
    os.unlink(_weights_blob(store, "t/c"))  # a blob removed by hand
    assert _census(store) == _whole(root)
    assert [d[0] for d in _census(store)[1]] == ["broken", "t/c"]
    flip_byte(_weights_blob(store, "t/a"), -1)
    with pytest.raises(IntegrityError):
        store.verify("t/a")  # quarantined
    assert _census(store) == _whole(root)
    assert [d[0] for d in _census(store)[1]] == ["broken", "t/a", "t/c"]
    store.stage(store_adapters["b"], "t/a")  # the bytes committed again: repaired
    store.stage(store_adapters["c"], "t/c")
    store.unstage("broken")
    assert _census(store) == _whole(root) == (["t/a", "t/c"], [])


def test_a_settled_census_reads_no_ref_again_until_someone_else_changes_the_store(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    root = tmp_path / "s"
    store = AdapterStore(root, chunk_size=SMALL_CHUNK)
    for adapter_id in ("t/a", "t/b"):
        store.stage(store_adapters["a"], adapter_id)
    _settle(root)
    reads: list[int] = []
    every_ref = store._catalog.refs

    def counted() -> dict[str, str]:
        reads.append(1)
        return every_ref()

    store._catalog.refs = counted  # type: ignore[method-assign]
    assert _census(store) == (["t/a", "t/b"], []) and len(reads) == 1
    assert _census(store) == (["t/a", "t/b"], []) and len(reads) == 1  # kept: no ref read
    AdapterStore(root, chunk_size=SMALL_CHUNK).stage(store_adapters["b"], "t/c")  # another process's commit
    assert _census(store) == (["t/a", "t/b", "t/c"], []) and len(reads) == 2
