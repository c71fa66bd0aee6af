"""PeftAdapterConfig: strict parsing of what PEFT 0.21 writes, and per-module rank and scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.errors import InvalidConfig
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

MODULES = [
    f"model.layers.{i}.{block}.{name}"
    for i in range(2)
    for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for name in names
]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """Configs exactly as PEFT's save_pretrained writes them."""
    root = tmp_path_factory.mktemp("configs")
    base = build_tiny_model()
    variants = {
        "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"], use_rslora=True),
        "patterns": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 4}),
        "regex": dict(r=2, lora_alpha=4, target_modules=r".*\.mlp\.(up|down)_proj"),
        "all_linear": dict(r=2, lora_alpha=2, target_modules="all-linear"),
        "layers": dict(r=4, lora_alpha=4, target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="layers"),
    }
    return {name: json.loads((make_peft_adapter(root / name, base_model=base, **kw) / "adapter_config.json").read_text()) for name, kw in variants.items()}


def test_peft_written_configs_parse(written: dict) -> None:
    plain = PeftAdapterConfig.from_dict(written["plain"])
    assert (plain.r, plain.lora_alpha, plain.target_modules) == (8, 16, ("q_proj", "v_proj"))
    assert PeftAdapterConfig.from_dict(written["regex"]).target_modules == r".*\.mlp\.(up|down)_proj"
    # PEFT expands "all-linear" to the module names it found before saving; a hand-written one stays a marker.
    assert len(PeftAdapterConfig.from_dict(written["all_linear"]).target_modules) == len(MODULES)
    marker = PeftAdapterConfig.from_dict(dict(written["plain"], target_modules="all-linear"))
    assert marker.target_modules == "all-linear" and all(marker.targets(m) for m in MODULES)


@pytest.mark.parametrize("variant", ["plain", "rslora", "patterns", "regex", "layers"])
def test_module_matching_agrees_with_peft(written: dict, variant: str) -> None:
    """targets() must select exactly the modules PEFT itself put LoRA on."""
    from peft.tuners.tuners_utils import check_target_module_exists

    ours = PeftAdapterConfig.from_dict(written[variant])
    theirs = ours.to_lora_config()
    for module in MODULES:
        assert ours.targets(module) == bool(check_target_module_exists(theirs, module)), module


def test_scaling_per_module(written: dict) -> None:
    rslora = PeftAdapterConfig.from_dict(written["rslora"])
    assert rslora.scaling_for("model.layers.0.self_attn.q_proj") == pytest.approx(8 / math.sqrt(4))
    patterns = PeftAdapterConfig.from_dict(written["patterns"])
    assert patterns.rank_for("model.layers.1.self_attn.v_proj") == 2
    assert patterns.scaling_for("model.layers.1.self_attn.v_proj") == pytest.approx(16 / 2)
    assert patterns.scaling_for("model.layers.1.mlp.up_proj") == pytest.approx(4 / 8)
    assert patterns.scaling_for("model.layers.0.self_attn.q_proj") == pytest.approx(16 / 8)
    assert patterns.max_rank == 8


def test_scaling_matches_peft_layers(tmp_path: Path) -> None:
    """The scaling PEFT's own LoRA layers hold equals ours, module by module."""
    from peft import get_peft_model

    base = build_tiny_model()
    ours = PeftAdapterConfig(r=4, lora_alpha=6, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3})
    peft_model = get_peft_model(base, ours.to_lora_config())
    seen = 0
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
            assert module.scaling["default"] == pytest.approx(ours.scaling_for(name)), name
            assert module.r["default"] == ours.rank_for(name), name
            seen += 1
    assert seen == 6


def test_round_trip_through_peft_lora_config(written: dict) -> None:
    for raw in written.values():
        ours = PeftAdapterConfig.from_dict(raw)
        assert PeftAdapterConfig.from_lora_config(ours.to_lora_config()) == ours


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("use_dora", True, r"use_dora=True is not supported \(DoRA"),
        ("bias", "all", r"bias='all' is not supported"),
        ("bias", "lora_only", r"bias='lora_only' is not supported"),
        ("modules_to_save", ["lm_head"], r"modules_to_save=\['lm_head'\] is not supported"),
        ("lora_bias", True, r"lora_bias=True is not supported"),
        ("trainable_token_indices", [1, 2], r"trainable_token_indices=\[1, 2\] is not supported"),
        ("target_parameters", ["experts.weight"], r"target_parameters=\['experts.weight'\] is not supported"),
        ("layer_replication", [[0, 1]], r"layer_replication=\[\[0, 1\]\] is not supported"),
        ("fan_in_fan_out", True, r"fan_in_fan_out=True is not supported"),
        ("peft_type", "IA3", r"peft_type='IA3' is not supported"),
        ("r", 0, r"r=0 must be a positive integer"),
        ("r", -4, r"r=-4 must be a positive integer"),
        ("r", 2.5, r"r=2.5 must be a positive integer"),
        ("lora_alpha", float("nan"), r"lora_alpha=nan must be a finite positive number"),
        ("lora_alpha", float("inf"), r"lora_alpha=inf must be a finite positive number"),
        ("lora_alpha", 0, r"lora_alpha=0 must be a finite positive number"),
        ("lora_alpha", -1, r"lora_alpha=-1 must be a finite positive number"),
        ("rank_pattern", {"v_proj": 0}, r"rank_pattern\['v_proj'\]=0 must be a positive integer"),
        ("alpha_pattern", {"v_proj": -2}, r"alpha_pattern\['v_proj'\]=-2 must be a finite positive number"),
        ("target_modules", [], r"target_modules is empty"),
        ("target_modules", "([", r"target_modules='\(\[' is not a valid regular expression"),
        ("use_rslora", "yes", r"use_rslora='yes' must be true or false"),
        ("layers_to_transform", [-1], r"layers_to_transform=\[-1\] must be"),
        ("some_future_feature", {"on": True}, r"unknown setting some_future_feature=\{'on': True\}"),
    ],
)
def test_unsupported_settings_are_refused_by_name(written: dict, key: str, value, message: str) -> None:
    raw = dict(written["plain"], **{key: value})
    with pytest.raises(InvalidConfig, match=message):
        PeftAdapterConfig.from_dict(raw)


def test_layer_limit_with_a_pattern_target_is_refused(written: dict) -> None:
    raw = dict(written["regex"], layers_to_transform=[0])
    with pytest.raises(InvalidConfig, match=r"layers_to_transform=\[0\] cannot be combined with target_modules="):
        PeftAdapterConfig.from_dict(raw)


def test_neutral_unknown_keys_and_training_only_settings_are_accepted(written: dict) -> None:
    raw = dict(written["plain"], lora_dropout=0.3, some_future_flag=None, another_future_list=[])
    assert PeftAdapterConfig.from_dict(raw) == PeftAdapterConfig.from_dict(written["plain"])


def test_missing_required_keys(written: dict) -> None:
    for key in ("r", "target_modules"):
        raw = {k: v for k, v in written["plain"].items() if k != key}
        with pytest.raises(InvalidConfig, match=f"{key} is missing"):
            PeftAdapterConfig.from_dict(raw)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must hold a JSON object, not list"),
    ],
)
def test_malformed_files(data: bytes, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        PeftAdapterConfig.from_json_bytes(data)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="adapter_config.json does not exist"):
        PeftAdapterConfig.from_dir(tmp_path)


# Target-module matching is ours (PEFT's check_target_module_exists needs a LoraConfig and runs on a
# live model's names); this table pins it to PEFT's own function on every supported architecture,
# so a PEFT upgrade that changes matching fails here instead of drifting silently.
MATCHING_TABLE = [
    dict(target_modules=["q_proj"]),
    dict(target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(target_modules=["self_attn.q_proj", "mlp.up_proj"]),
    dict(target_modules=["proj"]),  # a suffix that is not a whole name component matches nothing
    dict(target_modules=["layers.1.self_attn.o_proj"]),
    dict(target_modules=r".*\.mlp\.(up|down)_proj"),
    dict(target_modules=r"model\.layers\.0\..*"),
    dict(target_modules=r".*_proj"),
    dict(target_modules=r"q_proj"),  # a string is a full-match regex, so a bare name matches nothing nested
    dict(target_modules=["q_proj", "k_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj", "k_proj"], layers_to_transform=0),
    dict(target_modules=["gate_proj"], layers_to_transform=[0, 1], layers_pattern="layers"),
    dict(target_modules=["v_proj"], layers_to_transform=[1], layers_pattern=["layers"]),
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family_modules(request) -> tuple[str, list[str]]:
    import torch

    model = build_tiny_model(request.param)
    return request.param, [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


@pytest.mark.parametrize("settings", MATCHING_TABLE, ids=lambda s: json.dumps(s, sort_keys=True))
def test_matching_table_agrees_with_peft(family_modules: tuple[str, list[str]], settings: dict) -> None:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    family, modules = family_modules
    raw = dict(peft_type="LORA", r=4, lora_alpha=8, **settings)
    ours = PeftAdapterConfig.from_dict(raw)
    theirs = LoraConfig(r=4, lora_alpha=8, **settings)
    differ = [m for m in modules if ours.targets(m) != bool(check_target_module_exists(theirs, m))]
    assert not differ, f"{family}: matching differs from PEFT on {differ}"
