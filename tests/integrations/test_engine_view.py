"""The engines' view (--engine-url) against vLLM's own /v1/models and LoRA registry, beside real node processes.

The engine is ``tests/support/vllm_engine.py``: vLLM's OpenAI serving layer over HTTP with only its engine
core replaced; adapters reach its registry the way a request naming them does (the fabric's resolver
plugin pulls and exports them). The sidecar node's store holds about two adapters, so a third commit evicts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from adapter_fabric.cli.main import run as cli
from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.export import export_name, version_name
from adapter_fabric.store.manifest import CONFIG_FILE
from tests.support import ROOT
from tests.support.scrape import scrape
from tests.integrations.test_vllm import VLLM_MISSING

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(VLLM_MISSING, reason="vLLM is not installed here (scripts/bootstrap.sh could not install it; see its output)"),
]

IDS = ["team-a/one", "team-a/two", "team-a/three"]


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A seed holding three adapters for the served base model "tiny" (so the peers always hold a copy elsewhere)."""
    root = tmp_path_factory.mktemp("engine-view")
    model = build_tiny_model()
    node = LocalNode(root / "seed", model="none", port=free_port()).start()
    with node.client() as client:
        for seed_number, adapter_id in enumerate(IDS):
            directory = make_peft_adapter(root / f"a{seed_number}", base_model=model, r=8, target_modules=["q_proj", "v_proj"], seed=seed_number)
            config = json.loads((directory / CONFIG_FILE).read_text())
            config["base_model_name_or_path"] = "tiny"
            (directory / CONFIG_FILE).write_text(json.dumps(config))
            client.stage(directory, adapter_id)
        size = client.list().staged[0].size
    yield node, size
    node.stop()


class Engine:
    """tests/support/vllm_engine.py in its own process, resolving through the node at ``node``."""

    def __init__(self, export: Path, node: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
        env.update(FABRIC_EXPORT_DIR=str(export), FABRIC_NODE=node)
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "vllm_engine.py"), "tiny"], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        line = self.process.stdout.readline()
        match = re.search(r"engine listening on (\d+)", line)
        assert match, f"the engine did not start: {line!r}"
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(30)


def staged(node: LocalNode) -> dict[str, tuple[str, ...]]:
    with node.client() as client:
        return {a.adapter_id: a.engines for a in client.list().staged}


def test_an_adapter_vllm_registered_is_held_and_shown_and_goes_once_vllm_unloads_it(seed, tmp_path, capsys) -> None:
    seed_node, size = seed
    export = tmp_path / "export"
    export.mkdir()  # the engine's plugin checks it at start; the node fills it
    port = free_port()
    engine = Engine(export, f"127.0.0.1:{port}")  # resolves through the sidecar below once it is up
    sidecar = LocalNode(
        tmp_path / "sidecar", model="none", port=port, peers=[seed_node.address],
        extra_args=["--export-dir", str(export), "--engine-url", engine.url, "--max-store-bytes", str(int(size * 2.5)), "--metrics-listen", "127.0.0.1:0"],
    ).start()  # fmt: skip
    label = engine.url.removeprefix("http://")
    try:
        path = engine.post("/test/request", {"model": IDS[0]})["path"]  # vLLM registered it, from its digest's entry
        with sidecar.client() as client:
            assert path == str(export / version_name(IDS[0], client.manifest(IDS[0]).digest))
            client.pull(IDS[1], peer=seed_node.address)
            client.pull(IDS[2], peer=seed_node.address)  # past the limit: the least recently used is IDS[0], but vLLM names it
        left = staged(sidecar)
        assert IDS[0] in left and IDS[1] not in left and IDS[2] in left, left
        assert (export / export_name(IDS[0]) / CONFIG_FILE).is_file()
        assert left[IDS[0]] == (label,) and left[IDS[2]] == ()  # as read afresh by the eviction
        assert cli(["ls", sidecar.address]) == 0
        assert f"engines: {label}" in capsys.readouterr().out
        assert scrape(sidecar)[("fabric_engine_adapters", frozenset({("engine", label)}))] == 1.0

        engine.post("/test/unload", {"lora_name": IDS[0]})  # vLLM no longer names it: it may go
        with sidecar.client() as client:
            client.pull(IDS[1], peer=seed_node.address)
        left = staged(sidecar)
        assert IDS[0] not in left and IDS[1] in left, left

        # An engine that stops answering: what it listed stays held, and the listing says it is not answering
        engine.post("/test/request", {"model": IDS[2]})
        with sidecar.client() as client:
            client.pull(IDS[0], peer=seed_node.address)  # an eviction (of IDS[1]) reads the engine: it names IDS[2]
        assert staged(sidecar)[IDS[2]] == (label,)
        engine.stop()
        with sidecar.client() as client:
            client.pull(IDS[1], peer=seed_node.address)  # the next eviction reads the engine afresh, and fails
        left = staged(sidecar)
        assert IDS[2] in left and left[IDS[2]] == (f"{label} (not answering: held as last read)",), left
        assert cli(["ls", sidecar.address]) == 0
        assert f"engines: {label} (not answering" in capsys.readouterr().out
    finally:
        sidecar.stop()
        engine.stop()


def test_an_engine_that_never_answered_holds_every_exported_adapter_and_the_refusal_names_it(seed, tmp_path) -> None:
    seed_node, size = seed
    silent = f"127.0.0.1:{free_port()}"
    node = LocalNode(
        tmp_path / "node", model="none", port=free_port(), peers=[seed_node.address],
        extra_args=["--export-dir", str(tmp_path / "export"), "--engine-url", f"http://{silent}", "--max-store-bytes", str(int(size * 2.5))],
    ).start()  # fmt: skip
    try:
        with node.client() as client:
            client.pull(IDS[0], peer=seed_node.address)
            client.pull(IDS[1], peer=seed_node.address)
            with pytest.raises(QuotaExceeded, match=f"exported while engine {silent} has not answered GET /v1/models"):
                client.pull(IDS[2], peer=seed_node.address)
        assert sorted(staged(node)) == sorted(IDS[:2])  # nothing dropped for the refusal
    finally:
        node.stop()
