"""scripts/gpu_check on a machine without CUDA: the CPU half runs, then it stops before the CUDA rows and says so."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu_check itself")
def test_gpu_check_runs_the_cpu_half_and_names_what_needs_a_gpu() -> None:
    # One parity test of the CPU half is enough to show it runs them: this suite runs all of them (tests/serving), and
    # the whole CPU half cost ~25 CPU-seconds more. PYTEST_ADDOPTS is pytest's own; the script is run as it ships.
    narrowed = {**os.environ, "PYTEST_ADDOPTS": "-k test_mixed_batch_matches_peft_adapter_names_forward"}
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check")], capture_output=True, text=True, cwd=ROOT, timeout=540, env=narrowed)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no CUDA device here" in done.stderr
    assert "1 passed" in done.stdout and " failed" not in done.stdout  # the parity test ran on CPU
    assert "stopped before the CUDA rows" in done.stderr and "they need a GPU" in done.stderr
