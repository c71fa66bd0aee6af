#!/usr/bin/env python3
"""Metadata at scale: one node holding many adapters, against the same node holding few, side by side.

    .venv/bin/python scripts/bench_metadata.py                         # 1,000 and 100,000 adapters
    .venv/bin/python scripts/bench_metadata.py --counts 1000,10000 --reuse

Per count: a store directory populated in-process through the store's own
API (``adapter_fabric.harness.adapter_sets``: real PEFT adapters of the tiny model and
distinct ones derived from them), then a store-only node process started on
it. Measured: start-up to health SERVING, the node's RSS after start, a full
paged listing (time, pages, entries; RSS after it, and the peak), Locate of one
adapter (median of ``--probes``), store-status (median of ``--probes``), the unstage of one more
adapter staged for it (median of ``--probes``).
The last column is the ratio of the largest count's figure to the smallest's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapter_fabric.harness import adapter_sets  # noqa: E402
from adapter_fabric.harness.cluster import LocalNode  # noqa: E402
from adapter_fabric.harness.flag_bounds import refuse_out_of_range  # noqa: E402
from adapter_fabric.node.slots import MAX_PAGE_SIZE  # noqa: E402

#: the largest count a run may ask for (the issue's 100,000 with room)
MAX_COUNT = 200_000
QUICK_COUNTS = "100,1000"


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(call, probes: int) -> float:
    """The median seconds of ``probes`` calls."""
    seconds = []
    for _ in range(probes):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def populated(work: Path, count: int, jobs: int, reuse: bool) -> Path:
    """A store holding ``count`` adapters (kept from an earlier run with ``reuse``)."""
    root = work / f"c{count}"
    done = root / "POPULATED"
    if reuse and done.is_file():
        return root / "store"
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    reals = adapter_sets.real_adapters(root / "reals", rank=2, targets=("q_proj",))
    adapter_sets.populate(root / "store", reals, count, jobs=jobs)
    done.write_text(str(count))
    print(f"{count} adapters staged in-process in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return root / "store"


def one_more(work: Path, n: int) -> Path:
    """A real adapter's weights under a config of its own (``lora_alpha`` differs): a digest no other id refers to."""
    real = sorted((work / "reals").iterdir())[0]
    out = work / "extra" / str(n)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((real / "adapter_config.json").read_text())
    config["lora_alpha"] = 1000 + n
    (out / "adapter_config.json").write_text(json.dumps(config))
    shutil.copyfile(real / "adapter_model.safetensors", out / "adapter_model.safetensors")
    return out


def measure(store: Path, count: int, probes: int, page_size: int) -> dict:
    """The figures of one node started on ``store``."""
    node = LocalNode(store, model="none", extra_args=["--log-level", "WARNING"])
    start = time.perf_counter()
    node.start()
    row: dict = {"adapters": count, "start_to_serving_s": time.perf_counter() - start}
    try:
        row["rss_after_start_mib"] = rss_mib(node.pid)
        with node.client(timeout=600) as c:
            start, pages, entries = time.perf_counter(), 0, 0
            for page in c.list_pages(page_size):
                pages += 1
                entries += len(page.staged)
            row.update(listing_s=time.perf_counter() - start, pages=pages, entries=entries)
            row["rss_after_listing_mib"] = rss_mib(node.pid)
            some = adapter_sets.adapter_id(count // 2)
            row["locate_s"] = timed(lambda: c.locate(some), probes)
            row["store_status_s"] = timed(c.store_status, probes)
            # An unstage collects what its id alone reached: before the live index it read every ref and manifest.
            unstages = []
            for n in range(probes):
                c.stage(one_more(store.parent, n), f"bench/unstage-{n}")  # a digest of its own: the unstage drops it
                start = time.perf_counter()
                c.unstage(f"bench/unstage-{n}")
                unstages.append(time.perf_counter() - start)
            row["unstage_s"] = statistics.median(unstages)
            row["rss_peak_mib"] = rss_mib(node.pid, "VmHWM")
        if entries != count:
            raise SystemExit(f"the listing held {entries} adapters, the store {count}")
    finally:
        node.stop()
    return row


ROWS = [
    ("start-up to SERVING", "start_to_serving_s", "{:.2f} s"),
    ("RSS after start", "rss_after_start_mib", "{:.0f} MiB"),
    ("full paged listing", "listing_s", "{:.2f} s"),
    ("pages", "pages", "{}"),
    ("RSS after the listing", "rss_after_listing_mib", "{:.0f} MiB"),
    ("Locate (median)", "locate_s", "{:.1f} ms"),
    ("store-status (median)", "store_status_s", "{:.1f} ms"),
    ("unstage of one adapter (median)", "unstage_s", "{:.1f} ms"),
    ("RSS peak", "rss_peak_mib", "{:.0f} MiB"),
]


def report(rows: list[dict]) -> str:
    head = " | ".join(f"{r['adapters']:,} adapters" for r in rows)
    lines = [f"| figure | {head} | ratio |", "|---" + "|---:" * (len(rows) + 1) + "|"]
    for label, key, fmt in ROWS:
        scale = 1000 if fmt.endswith("ms") else 1
        cells = " | ".join(fmt.format(r[key] * scale) for r in rows)
        ratio = rows[-1][key] / rows[0][key] if rows[0][key] else 0.0
        lines.append(f"| {label} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1000,100000", help=f"comma-separated adapter counts, smallest first (each 1 to {MAX_COUNT:,})")
    parser.add_argument("--probes", type=int, default=7, help="calls timed per Locate and store-status figure (1 to 100)")
    parser.add_argument("--page-size", type=int, default=0, help=f"adapters per listing page (0 to {MAX_PAGE_SIZE}; 0: the node's default)")
    parser.add_argument("--jobs", type=int, default=2, help="processes staging the adapters (1 to 16)")
    parser.add_argument("--quick", action="store_true", help=f"counts {QUICK_COUNTS}")
    parser.add_argument("--work", default="/dev/shm/fabric-bench-metadata", help="the stores (tmpfs keeps the disk out of the figures)")
    parser.add_argument("--reuse", action="store_true", help="keep the populated stores and use them again next run")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    args = parser.parse_args()
    try:
        counts = [int(c) for c in (QUICK_COUNTS if args.quick else args.counts).split(",")]
    except ValueError:
        counts = []
    if not counts or not all(1 <= c <= MAX_COUNT for c in counts) or counts != sorted(counts):
        parser.error(f"--counts takes adapter counts separated by commas, smallest first, each 1 to {MAX_COUNT} (a store per count), not {args.counts!r}")
    refuse_out_of_range(parser, (
        ("--probes", args.probes, 1, 100, "calls timed per figure, a median"),
        ("--page-size", args.page_size, 0, MAX_PAGE_SIZE, "0: the node's default; a node sends at most that many per page"),
        ("--jobs", args.jobs, 1, 16, "processes staging the adapters"),
    ))
    work = Path(args.work)
    try:
        rows = [measure(populated(work, count, args.jobs, args.reuse), count, args.probes, args.page_size) for count in counts]
    finally:
        if not args.reuse:
            shutil.rmtree(work, ignore_errors=True)
    print(report(rows))
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
