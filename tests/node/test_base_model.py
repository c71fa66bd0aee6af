"""Issue 33: a node checks an adapter's base_model_name_or_path against its model before a promote loads it
(an adapter made for tiny-qwen2 was promoted on a tiny node), by the rule operators write (adapter_fabric.format.base_model)."""

from __future__ import annotations

import json

import pytest

from adapter_fabric.errors import IncompatibleAdapter
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.manifest import CONFIG_FILE

pytestmark = pytest.mark.slow  # a real node process


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("base-model")
    started = LocalNode(root / "n", model="tiny", port=free_port(), slots=2, extra_args=["--base-model", "acme/Tiny-Renamed"]).start()
    base = build_tiny_model()
    with started.client() as client:
        for name, claimed in (("qwen", "tiny-qwen2"), ("upper", "TINY"), ("alias", "acme/tiny-renamed"), ("none", None)):
            directory = make_peft_adapter(root / name, base_model=base, r=4, seed=3)
            config = json.loads((directory / CONFIG_FILE).read_text())
            config["base_model_name_or_path"] = claimed
            (directory / CONFIG_FILE).write_text(json.dumps(config))
            client.stage(directory, f"base/{name}")  # staging stores any adapter: the check is the promote's
    yield started
    started.stop()


def test_an_adapter_for_another_model_is_refused_naming_the_fix(node) -> None:
    with node.client() as client:
        before = client.list().slots
        with pytest.raises(IncompatibleAdapter) as refused:
            client.promote("base/qwen", name="q")
        assert client.list().slots == before  # nothing loaded, nothing evicted
    message = str(refused.value)
    assert "'tiny-qwen2'" in message and "this node serves tiny, acme/Tiny-Renamed" in message and "--base-model tiny-qwen2" in message


@pytest.mark.parametrize("name", ["upper", "alias", "none"])
def test_the_models_names_as_operators_write_them_are_accepted(node, name) -> None:
    with node.client() as client:
        assert client.promote(f"base/{name}", name=name).slot >= 0
