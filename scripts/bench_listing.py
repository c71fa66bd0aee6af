#!/usr/bin/env python
"""Listing and store status against the number of staged ids: in-process pages, and node processes at 100,000 side by side.

Two measurements:

``--sizes`` (in-process): one real adapter is staged; the other ids are
written as refs to its digest straight into the store's refs/ (no fsync:
this measures listing, not staging). For each store size, the median time of
one whole page (``AdapterStore.page``, what a ListAdapters page reads) is
taken beside the previous way (every name in refs/ read, the page's ids picked
with ``heapq.nsmallest``), in one run: the picking of the ids alone, and the
whole page. Prints milliseconds per page and the ratio to the smallest store::

    python scripts/bench_listing.py --sizes 1000,20000 --reps 15

``--nodes COUNT`` (node processes): one store of COUNT distinct adapters
(``fill_distinct``: a real PEFT adapter's tensor layout with values of each
adapter's own, under one of four configs: every id has its own digest,
manifest and weights blob), then a store-only
node of the baseline tree (``--baseline``, a git revision: its ``fabric/``
and ``node/`` are exported to a scratch directory and imported first) and a
node of this tree, one after the other on the same store, each measured the
same way: start-up to SERVING, the start-up collection's end (its log line),
RSS idle after it, a ListAdapters page of ``--page`` ids at ``--reps``
places spread over the ids (median), the full paged listing, RSS after it,
StoreStatus (the first call, and the median of ``--reps`` after it), and
Availability of one adapter's digest asked by a scoped caller (a principal of
the node's ``--policy`` that may pull one tenant's ids: the node checks which
ids refer to the digest on every such call; median of ``--reps``), and that
caller's first ListAdapters page and StoreStatus (each reads every id to show
its own one), and its Stage and Unstage of a small adapter in its tenant,
which has a ``[[quota]]`` (every writer there asks for the tenant's usage)::

    python scripts/bench_listing.py --nodes 100000 --baseline t30 --reps 7
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from adapter_fabric.access.policy import MAX_QUOTAS
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.format.safetensors_index import read_index
from adapter_fabric.harness.adapter_sets import adapter_id as set_id
from adapter_fabric.harness.baseline import baseline_env, refuse_unknown_revision
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.harness.flag_bounds import refuse_out_of_range
from adapter_fabric.node.slots import MAX_PAGE_SIZE
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.files import decode_id
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE, hash_bytes, manifest_of
from adapter_fabric.v1 import fabric_pb2

ROOT = Path(__file__).resolve().parent.parent
#: the most ids a store here is filled with: the project's 100,000 on a node, with room
MAX_IDS = 200_000
#: the log line a node writes when its start-up collection ended (adapter_fabric.node.background)
COLLECTED = "collected what no ref reaches after the restart"


def fill(root: Path, adapter: Path, count: int) -> AdapterStore:
    """A store with ``count`` ids: one staged, the rest refs to its digest written directly."""
    store = AdapterStore(root)
    digest = store.stage(adapter, "bench/000000").digest
    for i in range(1, count):
        store._layout.ref(f"bench/{i:06d}").write_bytes(digest.encode("ascii"))
    return store


def fill_distinct(root: Path, adapter: Path, count: int) -> None:
    """A store of ``count`` ids (``adapter_sets.adapter_id``), each its own digest: the adapter's safetensors header over
    values of its own (its own weights blob), under one of four configs (``lora_alpha`` 8, 16, 24 or 32), as a multi-tenant
    store holds many adapters of a few shapes. Written directly, not synced: this measures reading a store, not filling one."""
    store = AdapterStore(root)
    layout = store._layout
    weights_path = adapter / WEIGHTS_FILE
    first = store.stage(adapter, set_id(0))
    whole, index = weights_path.read_bytes(), read_index(weights_path)
    header, body = whole[: 8 + index.header_size], len(whole) - 8 - index.header_size
    config = json.loads((adapter / CONFIG_FILE).read_text())
    configs = [json.dumps({**config, "lora_alpha": 8 * (n + 1)}).encode() for n in range(4)]
    rng = random.Random(1)
    for i in range(1, count):
        data = header + rng.randbytes(body)
        weights = hash_bytes(WEIGHTS_FILE, data, first.weights.chunk_size)
        manifest = manifest_of(set_id(i), configs[i % 4], weights, index)
        for entry, content in zip(manifest.files, (manifest.config_json, data)):
            blob = layout.blob(entry.root)
            if not blob.exists():
                blob.parent.mkdir(exist_ok=True)
                blob.write_bytes(content)
                blob.chmod(0o444)
        layout.manifest(manifest.digest).write_bytes(manifest.to_json())
        layout.ref(manifest.adapter_id).write_bytes(manifest.digest.encode("ascii"))


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


def in_process(args: argparse.Namespace, adapter: Path, tmp: Path) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        store = fill(tmp / f"s{size}", adapter, size)
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


# ---------------------------------------------------------------- node processes


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


SCOPED = set_id(7)  # an id of the one tenant the scoped caller may pull


def write_policy(where: Path, quotas: int = 1) -> tuple[Path, str]:
    """A policy of one scoped principal that may read, pull, publish and unstage in ``SCOPED``'s tenant only, which has a
    quota, as ``quotas - 1`` other tenants spread over the ids have; the admin's token file, and that principal's token."""
    where.mkdir(parents=True, exist_ok=True)
    admin, scoped = secrets.token_hex(32), secrets.token_hex(32)
    (where / "cluster.token").write_text(admin)
    (where / "policy.toml").write_text(
        "[[principal]]\n"
        'name = "one-tenant"\n'
        f'token_sha256 = "{hashlib.sha256(scoped.encode()).hexdigest()}"\n'
        f'grants = [{{ verbs = ["read", "pull", "publish", "unstage"], prefixes = ["{SCOPED.split("/")[0]}/"] }}]\n'
        "[[quota]]\n"
        f'prefix = "{SCOPED.split("/")[0]}/"\n'
        'max_bytes = "1GiB"\n'
        + "".join(f'[[quota]]\nprefix = "{set_id(n * 97 + 1).split("/")[0]}/"\nmax_adapters = 10\n' for n in range(quotas - 1))
    )
    return where / "cluster.token", scoped


def measure_node(store: Path, count: int, env: dict[str, str] | None, log: Path, page: int, reps: int, adapter: Path, quotas: int) -> dict[str, float]:
    log.unlink(missing_ok=True)  # the node appends: an earlier run's line must not count
    admin, scoped = write_policy(log.parent / "policy", quotas)
    policy = ["--policy", str(log.parent / "policy" / "policy.toml")]
    node = LocalNode(store, model="none", extra_args=["--log-level", "INFO", *policy], env=env, log_path=log, token_file=admin)
    start = time.perf_counter()
    node.start()
    row = {"serving_s": time.perf_counter() - start, "rss_serving_mib": rss_mib(node.pid)}
    try:
        while COLLECTED not in log.read_text(errors="replace"):
            if time.perf_counter() - start > 1200:
                raise SystemExit(f"the node's start-up collection did not end in 20 minutes (log: {log})")
            time.sleep(0.2)
        row["collected_s"] = time.perf_counter() - start
        time.sleep(1.0)
        row["rss_idle_mib"] = rss_mib(node.pid)
        with node.client(timeout=600) as client:
            stub = client.stub

            def one_page(after: str) -> None:
                reply = stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_size=page, page_token=after), timeout=600)
                assert len(reply.staged) == min(page, count - 1 - int(after.split("-")[1].split("/")[0])), len(reply.staged)

            # pages at places spread over the ids: each reads entries no earlier page read
            places = [set_id(int(count * (n + 0.5) / (reps + 1))) for n in range(reps)]
            row["page_s"] = statistics.median(timed(lambda: one_page(after)) for after in places)
            token, entries, start = "", 0, time.perf_counter()
            while True:
                reply = stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_size=page, page_token=token), timeout=600)
                entries += len(reply.staged)
                token = reply.next_page_token
                if not token:
                    break
            row["listing_s"] = time.perf_counter() - start
            if entries != count:
                raise SystemExit(f"the listing held {entries} adapters, the store {count}")
            row["rss_listed_mib"] = rss_mib(node.pid)
            status = lambda: stub.StoreStatus(fabric_pb2.StoreStatusRequest(), timeout=600)  # noqa: E731
            row["status_first_s"] = timed(status)
            row["status_s"] = statistics.median(timed(status) for _ in range(reps))
            assert status().adapters == count
            digest = client.manifest(SCOPED).digest
            with NodeClient(node.address, token=scoped, timeout=600) as caller:
                ask = lambda: caller.stub.Availability(fabric_pb2.AvailabilityRequest(digest=digest), timeout=600)  # noqa: E731
                assert ask().complete
                row["availability_s"] = statistics.median(timed(ask) for _ in range(reps))
                page_as_scoped = lambda: caller.stub.ListAdapters(fabric_pb2.ListAdaptersRequest(page_size=page), timeout=600)  # noqa: E731
                assert [a.adapter_id for a in page_as_scoped().staged] == [SCOPED]  # every other id walked past, none shown
                row["scoped_page_s"] = statistics.median(timed(page_as_scoped) for _ in range(reps))
                status_as_scoped = lambda: caller.stub.StoreStatus(fabric_pb2.StoreStatusRequest(), timeout=600)  # noqa: E731
                assert status_as_scoped().adapters == 1
                row["scoped_status_s"] = statistics.median(timed(status_as_scoped) for _ in range(reps))
                publish = lambda: (caller.stage(adapter, SCOPED + "-new"), caller.unstage(SCOPED + "-new"))  # noqa: E731
                row["quota_stage_s"] = statistics.median(timed(publish) for _ in range(reps))
            row["rss_peak_mib"] = rss_mib(node.pid, "VmHWM")
    finally:
        node.stop()
    return row


ROWS = [
    ("start-up to SERVING", "serving_s", 1, "s"),
    ("start-up collection ended", "collected_s", 1, "s"),
    ("RSS at SERVING", "rss_serving_mib", 1, "MiB"),
    ("RSS idle (collection done)", "rss_idle_mib", 1, "MiB"),
    ("one page (median)", "page_s", 1000, "ms"),
    ("full paged listing", "listing_s", 1, "s"),
    ("RSS after the listing", "rss_listed_mib", 1, "MiB"),
    ("RSS after the listing - idle", "rss_growth_mib", 1, "MiB"),
    ("StoreStatus, first", "status_first_s", 1000, "ms"),
    ("StoreStatus (median)", "status_s", 1000, "ms"),
    ("Availability of a digest, a scoped caller (median)", "availability_s", 1000, "ms"),
    ("a scoped caller's first page: its one id among all (median)", "scoped_page_s", 1000, "ms"),
    ("StoreStatus, a scoped caller (median)", "scoped_status_s", 1000, "ms"),
    ("Stage + Unstage of a small adapter, a tenant with a quota (median)", "quota_stage_s", 1000, "ms"),
    ("RSS peak", "rss_peak_mib", 1, "MiB"),
]


def ratio_text(ratio: float) -> str:
    """``0.84x``; a ratio under 0.01 as ``1/700`` (two decimals would print 0.00x)."""
    return f"{ratio:.2f}x" if ratio >= 0.01 or ratio <= 0 else f"1/{1 / ratio:,.0f}"


def nodes(args: argparse.Namespace, adapter: Path, tmp: Path) -> None:
    work = Path(args.work)
    store = work / f"store-{args.nodes}"
    if not (work / f"FILLED-{args.nodes}").is_file():
        shutil.rmtree(store, ignore_errors=True)
        started = time.perf_counter()
        fill_distinct(store, adapter, args.nodes)
        (work / f"FILLED-{args.nodes}").write_text(str(args.nodes))
        print(f"{args.nodes} adapters written in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    trees = [(f"baseline ({args.baseline})", baseline_env(ROOT, args.baseline, tmp / "baseline"))] if args.baseline else []
    trees.append(("this tree", None))
    rows: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for n in range(args.rounds):
        for label, env in trees:
            row = measure_node(store, args.nodes, env, work / f"node-{len(rows[label])}-{label.split()[0]}.log", args.page, args.reps, adapter, args.quotas)
            row["rss_growth_mib"] = row["rss_listed_mib"] - row["rss_idle_mib"]
            rows[label].append(row)
            print(f"round {n + 1} {label}: {json.dumps(row)}", file=sys.stderr, flush=True)
    medians = {label: {key: statistics.median(r[key] for r in found) for key in found[0]} for label, found in rows.items()}
    print(f"{args.nodes:,} adapters, store-only node processes, medians of {args.rounds} round(s); pages of {args.page}; {args.quotas} [[quota]] table(s) in the policy")
    columns = list(medians.values())
    print(f"| figure | {' | '.join(medians)} |{' this / baseline |' if len(columns) == 2 else ''}")
    print("|---|" + "---:|" * (len(columns) + (len(columns) == 2)))
    for name, key, scale, unit in ROWS:
        cells = " | ".join(f"{c[key] * scale:,.1f} {unit}" for c in columns)
        ratio = f" {ratio_text(columns[1][key] / columns[0][key])} |" if len(columns) == 2 and columns[0][key] else ""
        print(f"| {name} | {cells} |{ratio}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,20000", help="in-process: comma-separated store sizes (ids)")
    parser.add_argument("--nodes", type=int, default=0, help="node processes on a store of this many distinct adapters (0: in-process)")
    parser.add_argument("--baseline", default="HEAD", help="with --nodes: the git revision whose node is measured beside this tree's ('': this tree alone)")
    parser.add_argument("--rounds", type=int, default=1, help="with --nodes: baseline and this tree measured this many times each, in turn")
    parser.add_argument("--work", default="/dev/shm/fabric-bench-listing", help="with --nodes: where the store is written (tmpfs: no disk in the figures)")
    parser.add_argument("--keep", action="store_true", help="with --nodes: keep the store for the next run")
    parser.add_argument("--page", type=int, default=1000, help=f"ids per page (1 to {MAX_PAGE_SIZE}; default: the node's default page)")
    parser.add_argument("--quotas", type=int, default=1, help="with --nodes: [[quota]] tables in the node's policy (the scoped tenant's and others)")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if not 1 <= args.quotas <= MAX_QUOTAS:
        parser.error(f"--quotas takes 1 to {MAX_QUOTAS} (a policy holds at most that many [[quota]] tables), not {args.quotas}")
    if not (args.nodes == 0 or 8 <= args.nodes <= MAX_IDS):
        parser.error(f"--nodes takes 0 (in-process) or 8 to {MAX_IDS} (adapters in the nodes' store; the scoped caller's is the 8th), not {args.nodes}")
    sizes = args.sizes.split(",")
    if not all(size.isascii() and size.isdigit() and 1 <= int(size) <= MAX_IDS for size in sizes):
        parser.error(f"--sizes takes store sizes separated by commas, each 1 to {MAX_IDS} (ids written in-process), not {args.sizes!r}")
    refuse_out_of_range(parser, (
        ("--page", args.page, 1, MAX_PAGE_SIZE, "a node's most ids per ListAdapters page"),
        ("--reps", args.reps, 1, 1000, "calls timed per figure, a median"),
        ("--rounds", args.rounds, 1, 50, "each round starts both trees' nodes on the whole store"),
    ))
    refuse_unknown_revision(parser, ROOT, args.baseline if args.nodes else "")  # --baseline is for --nodes only
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_peft_adapter(Path(tmp) / "a", base_model=build_tiny_model(), r=4, lora_alpha=8, target_modules=["q_proj"], seed=1)
        (nodes if args.nodes else in_process)(args, adapter, Path(tmp))


if __name__ == "__main__":
    main()
