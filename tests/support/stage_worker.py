"""A separate process that works on a store, for the multi-process and kill -9 tests.

    stage_worker.py ROOT ITERATIONS DIR_A DIR_B [MANIFEST_JSON WEIGHTS]

Each iteration stages DIR_A or DIR_B (alternating) under the shared id
"shared", stages DIR_A under an id of its own and unstages one of its own ids
from two iterations ago. With MANIFEST_JSON and WEIGHTS it also downloads that
adapter into a partial one chunk per iteration, committing it as "pulled" once
complete and unstaging it again. It prints "tick <i>" after each iteration
(ITERATIONS = 0 runs until killed) and "done" at the end.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store import AdapterStore


def main(argv: list[str]) -> None:
    root, iterations, dir_a, dir_b = Path(argv[0]), int(argv[1]), Path(argv[2]), Path(argv[3])
    pull = (Manifest.from_json(Path(argv[4]).read_bytes()), Path(argv[5]).read_bytes()) if len(argv) > 4 else None
    store = AdapterStore(root, chunk_size=4096)
    me = f"worker/{os.getpid()}"
    next_chunk = 0
    for i in range(iterations) if iterations else itertools.count():
        store.stage(dir_a if i % 2 else dir_b, "shared")
        store.stage(dir_a, f"{me}-{i}")
        if i >= 2:
            store.unstage(f"{me}-{i - 2}")
        if pull is not None:
            next_chunk = _pull_one_chunk(store, *pull, next_chunk)
        print(f"tick {i}", flush=True)
    print("done", flush=True)


def _pull_one_chunk(store: AdapterStore, manifest: Manifest, data: bytes, index: int) -> int:
    partial = store.open_partial(manifest)
    offset, length = manifest.weights.chunk_span(index)
    partial.write_chunk(index, data[offset : offset + length])
    if index + 1 < manifest.weights.chunk_count:
        return index + 1
    partial.commit("pulled")
    store.unstage("pulled")
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
