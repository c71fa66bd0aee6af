"""scripts/bootstrap.sh picks a CPU build of torch on a machine without a GPU, or fails fast saying what to do."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # runs scripts/bootstrap.sh (the quick tier leaves it out: -m 'not slow')

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connection refused at once


def pick(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "bootstrap.sh")],
        capture_output=True, text=True, timeout=240, env={**os.environ, "FABRIC_TORCH_PICK_ONLY": "1", **env},
    )  # fmt: skip


def test_the_pick_is_a_cpu_build() -> None:
    """As configured on this machine (a local +cpu wheel beside newer CUDA builds), the CPU wheel is picked."""
    result = pick()
    if result.returncode != 0 and "cannot be reached" in result.stderr:
        pytest.skip("this machine offers no CPU build of torch and no CPU index")
    assert result.returncode == 0, result.stderr
    version, source = result.stdout.strip().split("\t")
    assert "+cpu" in version, result.stdout


def test_only_a_cuda_build_offered_and_no_cpu_index_fails_fast_with_what_to_do(tmp_path: Path) -> None:
    cuda = sorted(Path("/opt/pypi-more/files").glob("torch-2.*-cp311-*manylinux*.whl"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    if cuda:  # this machine has a CUDA wheel on disk: offer it alone, it must be refused
        (wheels / cuda[-1].name).symlink_to(cuda[-1])
    result = pick(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(wheels), PIP_INDEX_URL=f"{UNREACHABLE}/simple", FABRIC_TORCH_INDEX=f"{UNREACHABLE}/whl/cpu")
    assert result.returncode == 1 and result.stdout == ""
    assert f"{UNREACHABLE}/whl/cpu" in result.stderr and "FABRIC_TORCH_INDEX" in result.stderr


@pytest.mark.parametrize("workers", ["abc", "-1", "33", "1 2", ""])
def test_scripts_test_refuses_a_worker_count_out_of_bounds_by_name(workers: str) -> None:
    """FABRIC_TEST_WORKERS is checked before pytest starts: exit 2, naming the variable and its range."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test"), "--collect-only", "-q", "tests/store/test_ids.py"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "FABRIC_TEST_WORKERS": workers}, cwd=ROOT,
    )  # fmt: skip
    if workers == "":  # empty is unset in bash's ${VAR:-default}: the default count, and the run goes on
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2
    assert f"FABRIC_TEST_WORKERS={workers} must be a whole number from 0 (one process) to 32" in result.stderr
