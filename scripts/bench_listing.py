#!/usr/bin/env python
"""ListAdapters page cost against the number of staged ids: the sorted in-memory index vs a scan of refs/ per page.

One real adapter is staged; the other ids are written as refs to its digest
straight into the store's refs/ (no fsync: this measures listing, not staging).
For each store size, the median time of one whole page (``AdapterStore.page``,
what a ListAdapters page reads) is taken beside the previous way
(every name in refs/ read, the page's ids picked with ``heapq.nsmallest``), in
one run: the picking of the ids alone, and the whole page (the per-entry reads
are the same both ways). Prints seconds per page and the ratio to the smallest store.

Usage: ``python scripts/bench_listing.py [--sizes 1000,20000] [--page 1000] [--reps 15]``.
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.files import decode_id


def fill(root: Path, adapter: Path, count: int) -> AdapterStore:
    """A store with ``count`` ids: one staged, the rest refs to its digest written directly."""
    store = AdapterStore(root)
    digest = store.stage(adapter, "bench/000000").digest
    for i in range(1, count):
        store._layout.ref(f"bench/{i:06d}").write_bytes(digest.encode("ascii"))
    return store


def scan_ids(store: AdapterStore, after: str, count: int) -> list[str]:
    """The previous way of picking a page's ids: every name in refs/ read, for every page."""
    names = (decode_id(entry.name) for entry in os.scandir(store._layout.refs))
    return heapq.nsmallest(count, (n for n in names if n > after))


def scan_page(store: AdapterStore, after: str, count: int) -> list[str]:
    """The previous page: ``scan_ids``, then the same reads per entry as a page makes."""
    catalog = store._catalog
    listed = []
    for adapter_id in scan_ids(store, after, count):
        digest = catalog.read_ref(adapter_id)
        if digest is not None and not catalog.problem(digest) and catalog.load_manifest(digest) is not None:
            listed.append(adapter_id)
    return listed


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: the index built, the manifest cached
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,20000", help="comma-separated store sizes (ids)")
    parser.add_argument("--page", type=int, default=1000, help="ids per page (the node's default page)")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_peft_adapter(Path(tmp) / "a", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj"], seed=1)
        rows = []
        for size in sizes:
            store = fill(Path(tmp) / f"s{size}", adapter, size)
            after = "bench/000000"  # the second page's token on: a whole page at every size
            assert [e.adapter_id for e in store.page(after, args.page)] == scan_page(store, after, args.page)
            rows.append((
                size,
                median_seconds(lambda: store._catalog.index.page(after, args.page), args.reps),
                median_seconds(lambda: scan_ids(store, after, args.page), args.reps),
                median_seconds(lambda: store.page(after, args.page), args.reps),
                median_seconds(lambda: scan_page(store, after, args.page), args.reps),
            ))  # fmt: skip
    print(f"one page of {args.page} ids, median milliseconds of {args.reps}; x = ratio to the same column at {sizes[0]} ids")
    print(f"{'ids':>8} {'ids: index':>11} {'x':>6} {'ids: scan':>10} {'x':>6} {'page: index':>12} {'x':>6} {'page: scan':>11} {'x':>6}")
    for size, *times in rows:
        cells = " ".join(f"{t * 1000:>11.3f} {t / base:>6.2f}" for t, base in zip(times, rows[0][1:]))
        print(f"{size:>8} {cells}")

if __name__ == "__main__":
    main()
