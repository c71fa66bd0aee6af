"""scripts/bench_cache.py at its --quick size: real node processes, a Zipf stream, every figure of the report present.

No figure is asserted against a goal (timings depend on the machine); what must hold on any
machine: the run completes, the stream's requests are all accounted for, and every adapter
still has a complete copy somewhere (the origin never evicts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_cache_benchmark_runs_at_quick_size_and_reports_every_field(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_cache.py"), "--quick", "--json", "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report, _, figures = run.stdout.partition("\n{")
    result = json.loads("{" + figures)
    for line in ("refusals:", "hit ratio vs LRU:", "time to ready on a miss", "origin's share of bytes served after warm-up", "complete copies at the end"):
        assert line in report
    assert len(result["per_node"]) == result["nodes"] - 1 == 3
    for row in result["per_node"]:
        assert 0 <= row["hit_ratio"] <= 1 and 0 <= row["lru_ratio"] <= 1
    hits = sum(round(row["hit_ratio"] * row["requests"]) for row in result["per_node"])
    assert hits + result["miss_count"] + result["refusals"] + sum(result["errors"].values()) == result["requests"] == 400
    assert result["miss_count"] > 0 and result["alone_median_s"] > 0 and result["miss_p99_s"] >= result["miss_median_s"] > 0
    assert 0 <= result["origin_share_after_warmup"] <= 1 and result["served_bytes_after_warmup"] > 0
    assert result["adapters_without_copy"] == 0 and result["complete_copies"] == result["adapters"] == 120
    assert not (tmp_path / "work").exists()  # the run cleans up after itself
