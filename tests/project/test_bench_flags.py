"""The benchmarks' own bounds: a flag past its bound is refused by name before anything is built or started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, flag, words",
    [
        ("bench_listing.py", ["--nodes", "10", "--quotas", "1001"], "--quotas takes 1 to 1000"),
        ("bench_listing.py", ["--nodes", "10", "--quotas", "0"], "--quotas takes 1 to 1000"),
        ("bench_stage.py", ["--adapters", "20001"], "--adapters takes 1 to 20000"),
    ],
)
def test_a_flag_past_its_bound_is_refused_by_name(tmp_path: Path, script: str, flag: list[str], words: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *flag], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
