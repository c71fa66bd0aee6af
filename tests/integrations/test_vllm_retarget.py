"""Engines never mix versions: through vLLM's own serving layer, the request after an id's origin changed uses the new
weights, from a new path (vLLM's prefix cache keys a LoRA's blocks by name and path) under a new LoRA int id.

The engine is ``tests/support/vllm_engine.py`` (vLLM's OpenAI serving layer and LoRA registry on CPU, only the engine
core replaced); the node is a real process with a ``file://`` origin, ``--origin-ttl 0`` and the engine as
``--engine-url``. Nothing reaches the node for the adapter while vLLM holds it: the node's own round revalidates
what the engine holds, moves the id, and unloads it from vLLM; the test waits for that unload (vLLM's /v1/models
no longer listing the id), never for a time.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.export import version_name
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE
from tests.integrations.test_engine_view import Engine
from tests.integrations.test_vllm import VLLM_MISSING
from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(VLLM_MISSING, reason="vLLM is not installed here (scripts/bootstrap.sh could not install it; see its output)"),
]


def _adapter(where: Path, seed: int) -> Path:
    directory = make_peft_adapter(where, base_model=build_tiny_model(), r=8, target_modules=["q_proj", "v_proj"], seed=seed)
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "tiny"  # the model the engine serves
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return directory


def _listed(engine: Engine) -> dict[str, str]:
    with urllib.request.urlopen(f"{engine.url}/v1/models", timeout=30) as reply:
        return {card["id"]: card["root"] for card in json.loads(reply.read())["data"] if card.get("parent")}


def test_the_request_after_a_retarget_uses_the_new_weights_from_a_new_path(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    first, second = _adapter(tmp_path / "v1", seed=1), _adapter(tmp_path / "v2", seed=2)
    shutil.copytree(first, origin / "team-a" / "support")
    export = tmp_path / "export"
    export.mkdir()  # the engine's plugin checks it at start; the node fills it
    port = free_port()
    engine = Engine(export, f"127.0.0.1:{port}")
    node = LocalNode(
        tmp_path / "node", model="none", port=port,
        extra_args=["--export-dir", str(export), "--origin", f"file://{origin}", "--origin-ttl", "0", "--engine-url", engine.url,
                    "--metrics-listen", "127.0.0.1:0"],
    ).start()  # fmt: skip
    try:
        before = engine.post("/test/request", {"model": "team-a/support"})  # vLLM resolves the name: the node fetches it
        with node.client() as client:
            old = client.manifest("team-a/support").digest
        assert before["path"] == str(export / version_name("team-a/support", old))
        assert (Path(before["path"]) / WEIGHTS_FILE).read_bytes() == (first / WEIGHTS_FILE).read_bytes()

        for name in (CONFIG_FILE, WEIGHTS_FILE):  # the customer retrained: new files at the origin
            (origin / "team-a" / "support" / name).unlink()
            shutil.copyfile(second / name, origin / "team-a" / "support" / name)
        # the node's round revalidates what vLLM holds, moves the id, and unloads it from vLLM
        wait_for(lambda: "team-a/support" not in _listed(engine), "the node to unload the moved adapter from vLLM", timeout=120)

        after = engine.post("/test/request", {"model": "team-a/support"})  # the next request: resolved again
        with node.client() as client:
            new = client.manifest("team-a/support").digest
        assert new != old and after["path"] == str(export / version_name("team-a/support", new))
        assert (Path(after["path"]) / WEIGHTS_FILE).read_bytes() == (second / WEIGHTS_FILE).read_bytes()  # the new weights
        assert after["int_id"] != before["int_id"]  # vLLM's worker loads it anew, never from its cache of the old one
        assert after["cache_key"] != before["cache_key"]  # vLLM's own prefix-cache key: no block of the old weights matches
        samples = scrape(node)
        assert samples[("fabric_origin_revalidations_total", frozenset({("origin", f"file://{origin}"), ("result", "changed")}))] == 1
    finally:
        node.stop()
        engine.stop()
