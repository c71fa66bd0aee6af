"""SGLang's own code on CPU beside the fabric's environment (scripts/test_sglang installs it; CI does not).

The suite skips these, saying why, where SGLang is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here: run scripts/test_sglang (CI leaves it out)"),
]


def test_sglangs_http_server_and_lora_code_import_on_the_cpu_torch() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "sglang_probe.py")], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["sglang"] == "0.5.23" and "+cpu" in answer["torch"], answer  # pip left the CPU torch in place
    assert {"/load_lora_adapter", "/unload_lora_adapter", "/v1/models"} <= set(answer["lora_routes"]), answer
    assert answer["classes"] == ["TokenizerManager", "LoRARegistry", "LoRAManager"], answer
