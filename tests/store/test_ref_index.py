"""Issue 19: a page of the listing reads the sorted ids kept in memory, not every name in refs/ (adapter_fabric.store.ref_index).

Real stores on disk: this store's commits and unstages keep the index in
step; another store object on the same root (as another process) is seen
through the mtime of refs/.
"""

from __future__ import annotations

import os
from pathlib import Path

from adapter_fabric.store import AdapterStore
from adapter_fabric.store.ref_index import RefIndex
from adapter_fabric.store.stamps import RACY_NS
from tests.support.store import SMALL_CHUNK


def _ids(store: AdapterStore, after: str = "", count: int = 100) -> list[str]:
    return [entry.adapter_id for entry in store.page(after, count)]


def test_pages_follow_this_stores_commits_and_unstages(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    store = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    for adapter_id in ("m/2", "m/0", "m/1"):
        store.stage(store_adapters["a"], adapter_id)
    assert _ids(store, count=2) == ["m/0", "m/1"] and _ids(store, "m/1") == ["m/2"]
    store.stage(store_adapters["b"], "m/00")
    store.unstage("m/1")
    assert _ids(store) == ["m/0", "m/00", "m/2"]
    assert _ids(store, "m/2") == [] and _ids(store, "m/00", 1) == ["m/2"]


def test_another_store_on_the_same_root_is_seen(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    mine = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)
    mine.stage(store_adapters["a"], "x/a")
    assert _ids(mine) == ["x/a"]
    other = AdapterStore(tmp_path / "s", chunk_size=SMALL_CHUNK)  # as another process would
    other.stage(store_adapters["b"], "x/b")
    assert _ids(mine) == ["x/a", "x/b"]
    other.unstage("x/a")
    assert _ids(mine) == ["x/b"]


def test_a_page_scans_the_directory_only_when_it_changed_behind_the_index(tmp_path: Path) -> None:
    refs = tmp_path / "refs"
    refs.mkdir()
    for name in ("c", "a", "b"):
        (refs / name).touch()
    settled = os.stat(refs).st_mtime_ns - 2 * RACY_NS  # an mtime old enough to hide no change in its tick
    os.utime(refs, ns=(settled, settled))
    scans: list[int] = []

    def names() -> list[str]:
        scans.append(1)
        return [p.name for p in refs.iterdir()]

    index = RefIndex(refs, names)
    assert index.page("", 2) == ["a", "b"] and index.page("b", 2) == ["c"] and index.page("", 5) == ["a", "b", "c"]
    assert len(scans) == 1  # built once, then only searched
    (refs / "d").touch()
    os.utime(refs, ns=(settled, settled))
    index.ref_set("d")  # this process's own commit: the index is updated, not rebuilt
    (refs / "a").unlink()  # another process's unstage, in the same timestamp tick as that commit
    os.utime(refs, ns=(settled, settled))
    assert index.page("", 5) == ["b", "c", "d"]  # that tick is old: rebuilt once, so nothing hides behind it
    assert len(scans) == 2
    (refs / "e").touch()  # another process's commit moves the mtime: rebuilt again
    assert index.page("c", 5) == ["d", "e"] and len(scans) == 3
