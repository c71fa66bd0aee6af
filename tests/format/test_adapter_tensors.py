"""adapter_fabric.format.adapter_tensors: real PEFT adapters pass; adapters edited from a real state dict are refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import safetensors.torch
import torch

from adapter_fabric.format.adapter_tensors import LoraPair, lora_pairs, tensor_names
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.errors import InvalidTensors
from adapter_fabric.format.safetensors_index import read_index
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

WEIGHTS = "adapter_model.safetensors"
Q0 = "model.layers.0.self_attn.q_proj"
V1 = "model.layers.1.self_attn.v_proj"


@pytest.fixture(scope="module")
def base():
    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def default_adapter(base, tmp_path_factory) -> Path:
    """r=8 on q_proj and v_proj of both layers."""
    return make_peft_adapter(tmp_path_factory.mktemp("default"), base_model=base)


def _check(adapter: Path) -> dict[str, LoraPair]:
    return lora_pairs(read_index(adapter / WEIGHTS), PeftAdapterConfig.from_dir(adapter))


def _assert_fits_model(pairs: dict[str, LoraPair], base) -> None:
    for module, pair in pairs.items():
        linear = base.get_submodule(module)
        assert (pair.in_features, pair.out_features) == (linear.in_features, linear.out_features), module
        assert pair.a.shape == (pair.rank, pair.in_features) and pair.b.shape == (pair.out_features, pair.rank)
        assert (pair.a.name, pair.b.name) == tensor_names(module)


def _edited(adapter: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of a real adapter's weights file, with its state dict changed by ``edit``."""
    tensors = safetensors.torch.load_file(str(adapter / WEIGHTS))
    edit(tensors)
    path = tmp_path / WEIGHTS
    safetensors.torch.save_file(tensors, str(path))
    return path


def _refused(adapter: Path, tmp_path: Path, edit, config: PeftAdapterConfig | None = None) -> str:
    path = _edited(adapter, tmp_path, edit)
    with pytest.raises(InvalidTensors) as info:
        lora_pairs(read_index(path), config or PeftAdapterConfig.from_dir(adapter))
    return str(info.value)


# ---------------------------------------------------------------- real adapters


def test_default_adapter(default_adapter: Path, base) -> None:
    pairs = _check(default_adapter)
    assert list(pairs) == sorted(pairs) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert {p.rank for p in pairs.values()} == {8}
    assert (pairs[Q0].in_features, pairs[Q0].out_features) == (64, 64)
    assert (pairs[V1].in_features, pairs[V1].out_features) == (64, 32)  # 2 kv heads of 16
    _assert_fits_model(pairs, base)


def test_rank_pattern_and_alpha_pattern(base, tmp_path: Path) -> None:
    adapter = make_peft_adapter(
        tmp_path,
        base_model=base,
        r=8,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"v_proj": 4, r"layers\.1\.mlp\.down_proj": 2},
        alpha_pattern={"q_proj": 32},
    )
    pairs = _check(adapter)
    ranks = {m: p.rank for m, p in pairs.items()}
    assert ranks == {
        "model.layers.0.mlp.down_proj": 8,
        "model.layers.0.self_attn.q_proj": 8,
        "model.layers.0.self_attn.v_proj": 4,
        "model.layers.1.mlp.down_proj": 2,
        "model.layers.1.self_attn.q_proj": 8,
        "model.layers.1.self_attn.v_proj": 4,
    }
    _assert_fits_model(pairs, base)


def test_rslora_and_layers_to_transform(base, tmp_path: Path) -> None:
    adapter = make_peft_adapter(
        tmp_path, base_model=base, r=6, use_rslora=True, layers_to_transform=[1], target_modules=("k_proj", "up_proj")
    )
    pairs = _check(adapter)
    assert list(pairs) == ["model.layers.1.mlp.up_proj", "model.layers.1.self_attn.k_proj"]
    assert {p.rank for p in pairs.values()} == {6}
    _assert_fits_model(pairs, base)


def test_all_linear(base, tmp_path: Path) -> None:
    adapter = make_peft_adapter(tmp_path, base_model=base, r=2, target_modules="all-linear")
    pairs = _check(adapter)
    assert len(pairs) == 2 * 7 and "lm_head" not in pairs
    _assert_fits_model(pairs, base)


def test_regex_targets(base, tmp_path: Path) -> None:
    adapter = make_peft_adapter(tmp_path, base_model=base, r=3, target_modules=r".*\.0\.self_attn\.(q|o)_proj")
    pairs = _check(adapter)
    assert list(pairs) == ["model.layers.0.self_attn.o_proj", Q0]
    _assert_fits_model(pairs, base)


def test_half_precision_weights_pass(default_adapter: Path, tmp_path: Path) -> None:
    def to_half(t: dict) -> None:
        for i, name in enumerate(sorted(t)):
            t[name] = t[name].to((torch.bfloat16, torch.float16, torch.float64)[i % 3])

    path = _edited(default_adapter, tmp_path, to_half)
    pairs = lora_pairs(read_index(path), PeftAdapterConfig.from_dir(default_adapter))
    assert {p.a.dtype for p in pairs.values()} | {p.b.dtype for p in pairs.values()} == {"BF16", "F16", "F64"}


# ---------------------------------------------------------------- refusals


def test_no_tensors(default_adapter: Path, tmp_path: Path) -> None:
    message = _refused(default_adapter, tmp_path, lambda t: t.clear())
    assert "the adapter holds no tensors" in message


@pytest.mark.parametrize(
    "extra",
    [
        f"base_model.model.{Q0}.lora_B.bias",
        f"base_model.model.{Q0}.lora_magnitude_vector",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        f"base_model.model.{Q0}.lora_A.default.weight",  # adapter name left in
        f"{Q0}.lora_A.weight",  # no base_model.model. prefix
        "base_model.model.lora_A.weight",  # no module at all
    ],
)
def test_unexpected_tensor_name(default_adapter: Path, tmp_path: Path, extra: str) -> None:
    message = _refused(default_adapter, tmp_path, lambda t: t.__setitem__(extra, torch.zeros(4)))
    assert "1 tensor(s) are not PEFT LoRA weights" in message
    assert repr(extra) in message


def test_many_unexpected_names_are_counted(default_adapter: Path, tmp_path: Path) -> None:
    def add(t: dict) -> None:
        for i in range(7):
            t[f"extra.{i}"] = torch.zeros(1)

    message = _refused(default_adapter, tmp_path, add)
    assert "7 tensor(s)" in message and "'extra.0'" in message and "(+2 more)" in message


@pytest.mark.parametrize("dtype, code", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.bool, "BOOL")])
def test_non_float_dtype(default_adapter: Path, tmp_path: Path, dtype: torch.dtype, code: str) -> None:
    name = tensor_names(Q0)[0]
    message = _refused(default_adapter, tmp_path, lambda t: t.__setitem__(name, t[name].to(dtype)))
    assert f"tensor {name!r} has dtype {code}; LoRA weights must be one of BF16, F16, F32, F64" in message


def test_missing_lora_b(default_adapter: Path, tmp_path: Path) -> None:
    name_a, name_b = tensor_names(V1)
    message = _refused(default_adapter, tmp_path, lambda t: t.pop(name_b))
    assert message == f"module {V1!r}: lora_B is missing ({name_b!r}); lora_A is present"


def test_missing_lora_a(default_adapter: Path, tmp_path: Path) -> None:
    name_a, _ = tensor_names(Q0)
    message = _refused(default_adapter, tmp_path, lambda t: t.pop(name_a))
    assert message == f"module {Q0!r}: lora_A is missing ({name_a!r}); lora_B is present"


def test_a_not_2d(default_adapter: Path, tmp_path: Path) -> None:
    name_a, _ = tensor_names(Q0)
    message = _refused(default_adapter, tmp_path, lambda t: t.__setitem__(name_a, t[name_a].reshape(-1)))
    assert f"tensor {name_a!r} has shape [512] (1-D); it must be 2-D (rank, in_features)" in message


def test_b_not_2d(default_adapter: Path, tmp_path: Path) -> None:
    _, name_b = tensor_names(Q0)
    message = _refused(default_adapter, tmp_path, lambda t: t.__setitem__(name_b, t[name_b].reshape(64, 8, 1)))
    assert f"tensor {name_b!r} has shape [64, 8, 1] (3-D); it must be 2-D (out_features, rank)" in message


def test_rank_mismatch_between_a_and_b(default_adapter: Path, tmp_path: Path) -> None:
    name_a, _ = tensor_names(Q0)
    message = _refused(default_adapter, tmp_path, lambda t: t.__setitem__(name_a, t[name_a][:4].clone()))
    assert message == (
        f"module {Q0!r}: rank mismatch between lora_A shape [4, 64] (rank 4) and lora_B shape [64, 8] (rank 8)"
    )


def test_rank_disagrees_with_r(default_adapter: Path, tmp_path: Path) -> None:
    name_a, name_b = tensor_names(Q0)

    def shrink(t: dict) -> None:
        t[name_a] = t[name_a][:4].clone()
        t[name_b] = t[name_b][:, :4].clone()

    message = _refused(default_adapter, tmp_path, shrink)
    assert message == f"module {Q0!r}: tensors have rank 4 but the config gives rank 8 for it (r=8, rank_pattern={{}})"


def test_rank_disagrees_with_rank_pattern(default_adapter: Path, tmp_path: Path) -> None:
    config = dataclasses.replace(PeftAdapterConfig.from_dir(default_adapter), rank_pattern={"v_proj": 4})
    message = _refused(default_adapter, tmp_path, lambda t: None, config)
    assert message == (
        "module 'model.layers.0.self_attn.v_proj': tensors have rank 8 but the config gives rank 4 "
        "for it (r=8, rank_pattern={'v_proj': 4})"
    )


def test_module_not_targeted(default_adapter: Path, tmp_path: Path) -> None:
    config = dataclasses.replace(PeftAdapterConfig.from_dir(default_adapter), target_modules=("v_proj",))
    message = _refused(default_adapter, tmp_path, lambda t: None, config)
    assert message.startswith(f"module {Q0!r} has LoRA tensors but the config does not target it (r=8")


def test_module_outside_layers_to_transform(default_adapter: Path, tmp_path: Path) -> None:
    config = dataclasses.replace(PeftAdapterConfig.from_dir(default_adapter), layers_to_transform=(1,))
    message = _refused(default_adapter, tmp_path, lambda t: None, config)
    assert message.startswith(f"module {Q0!r} has LoRA tensors but the config does not target it")
