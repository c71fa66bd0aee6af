"""Base models: the built-in tiny presets and local transformers directories."""

from __future__ import annotations

import warnings

import pytest
import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.tiny import build_tiny_model, load_base_model, make_peft_adapter

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_presets_are_identical_everywhere(family) -> None:
    """Two builds (as on two nodes) give bit-identical weights, whatever the caller's RNG state."""
    torch.manual_seed(123)
    first = build_tiny_model(family)
    torch.manual_seed(456)
    second = build_tiny_model(family)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_local_model_directory_serves_adapters(tmp_path) -> None:
    build_tiny_model("qwen2").save_pretrained(tmp_path / "model")
    base = load_base_model(str(tmp_path / "model"))
    with torch.no_grad():
        assert torch.equal(base(IDS).logits, build_tiny_model("qwen2")(IDS).logits)

    adapter = make_peft_adapter(tmp_path / "adapter", family="qwen2", r=4, target_modules=["q_proj", "down_proj"])
    model = MultiLoraModel(base, slots=2, max_rank=8, device="cpu")
    slot, evicted = model.promote_lora_from_disk(adapter, "a")
    assert (slot, evicted) == (0, None)

    from peft import PeftModel

    reference = PeftModel.from_pretrained(build_tiny_model("qwen2"), adapter).eval()
    with torch.no_grad():
        assert (model.forward(IDS, ["a"]) - reference(IDS).logits).abs().max().item() < 1e-5


def test_unknown_model_is_named(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="'no-such-model' is neither a preset"):
        load_base_model("no-such-model")


def test_making_an_adapter_shows_no_library_deprecation_notice(tmp_path) -> None:
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing``; benchmarks and scripts that make adapters printed
    that FutureWarning to their users (the CLI filtered it for itself)."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        make_peft_adapter(tmp_path / "a", r=2, target_modules=["q_proj"])
    assert [str(w.message) for w in shown if "is_gradient_checkpointing" in str(w.message)] == []
