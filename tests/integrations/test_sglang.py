"""SGLang's own code on CPU beside the fabric's environment (scripts/test_sglang installs it; CI does not).

The suite skips these, saying why, where SGLang is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


# ---------------------------------------------------------------- a node driving SGLang (--sglang-url)

IDS = ["team-a/one", "team-a/two", "team-a/three"]


class Engine:
    """tests/support/sglang_engine.py in its own process: SGLang's own app and LoRA code over HTTP, on ``port``."""

    def __init__(self, port: int = 0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
        env["HF_HUB_OFFLINE"] = "1"  # a lora_path that is not a directory is a hub id: never fetched
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "sglang_engine.py"), str(port)], env=env, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        line = self.process.stdout.readline()
        match = re.search(r"engine listening on (\d+)", line)
        assert match, f"the engine did not start: {line!r}"
        self.port = int(match.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def get(self, route: str) -> dict:
        with urllib.request.urlopen(self.url + route, timeout=30) as reply:
            return json.loads(reply.read())

    def loaded(self) -> dict[str, str]:
        """SGLang's GET /v1/models: adapter name -> path."""
        return {c["id"]: c["root"] for c in self.get("/v1/models")["data"] if c.get("parent")}

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(30)


def until(what, timeout: float = 60.0):
    """``what()`` once it is truthy; AssertionError naming its last value otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            assert value, value
            return value
        time.sleep(0.2)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[dict[str, Path], int]:
    """Three PEFT adapters (save_pretrained) for the engine's tiny base model, and the staged size of one."""
    from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

    root = tmp_path_factory.mktemp("sglang-adapters")
    model = build_tiny_model()
    made = {i: make_peft_adapter(root / f"a{n}", base_model=model, r=8, target_modules=["q_proj", "v_proj"], seed=n) for n, i in enumerate(IDS)}
    return made, sum(f.stat().st_size for f in made[IDS[0]].iterdir() if f.name != "README.md")


def test_a_node_drives_sglang_through_stage_unstage_restarts_and_eviction(adapters, tmp_path) -> None:
    from adapter_fabric.harness.cluster import LocalNode, free_port
    from adapter_fabric.store.export import export_name

    made, size = adapters
    export = tmp_path / "export"
    seed = LocalNode(tmp_path / "seed", model="none", port=free_port()).start()  # another copy of each: eviction may drop them
    with seed.client() as client:
        for adapter_id in IDS:
            client.stage(made[adapter_id], adapter_id)
    engine = Engine()
    node_args = dict(
        model="none", port=free_port(), peers=[seed.address],
        extra_args=["--export-dir", str(export), "--sglang-url", engine.url, "--sglang-sync-interval", "2s", "--max-store-bytes", str(int(size * 2.5))],
    )  # fmt: skip
    node = LocalNode(tmp_path / "node", **node_args).start()
    name = {i: export_name(i) for i in IDS}
    try:
        with node.client() as client:
            client.stage(made[IDS[0]], IDS[0])
            client.pull(IDS[1], peer=seed.address)
        # staged or pulled: loaded into SGLang under the export name, from the export directory, by SGLang's own LoRAManager
        until(lambda: engine.loaded() == {name[i]: str(export / name[i]) for i in IDS[:2]})
        assert all(count > 0 for count in engine.get("/test/weights").values()), engine.get("/test/weights")
        until(lambda: all(v for v in {a.adapter_id: a.engines for a in node.client().list().staged}.values()), 30)  # fabric ls "engines:"

        with node.client() as client:
            client.unstage(IDS[1])
        until(lambda: engine.loaded() == {name[IDS[0]]: str(export / name[IDS[0]])})  # unstaged: unloaded

        engine.stop()  # SGLang restarts: none loaded, then every exported adapter again
        engine = Engine(engine.port)
        until(lambda: set(engine.loaded()) == {name[IDS[0]]})

        node.stop()  # the node restarts: it plans from what SGLang lists, loading nothing twice
        before = len(node.log_path.read_text())
        node = LocalNode(tmp_path / "node", **node_args).start()
        with node.client() as client:
            client.stage(made[IDS[1]], IDS[1])
        until(lambda: set(engine.loaded()) == {name[IDS[0]], name[IDS[1]]})
        since = node.log_path.read_text()[before:]
        loads = [line for line in since.splitlines() if "loaded an adapter into SGLang" in line]
        assert len(loads) == 1 and name[IDS[1]] in loads[0], loads

        # a third adapter passes the limit: the least recently used (IDS[0]) is unloaded from SGLang, then evicted
        with node.client() as client:
            client.pull(IDS[2], peer=seed.address)
            left = {a.adapter_id for a in client.list().staged}
        assert IDS[0] not in left and IDS[2] in left, left
        until(lambda: set(engine.loaded()) == {name[IDS[1]], name[IDS[2]]})
        log = node.log_path.read_text()
        unloaded = log.rfind(f"unloaded an adapter from SGLang engine={engine.url.removeprefix('http://')} adapter={name[IDS[0]]}")
        assert 0 <= unloaded < log.index("evicted a cold adapter"), log[-3000:]  # invariant 14: unloaded before its directory went
        assert "Traceback" not in log
    finally:
        node.stop()
        engine.stop()
        seed.stop()
