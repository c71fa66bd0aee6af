"""Numerical parity with PEFT: the same adapters through ``PeftModel`` and through ``MultiLoraModel``.

Adapters are written by PEFT's own ``save_pretrained`` on tiny models built in
code; references come from ``PeftModel.from_pretrained`` on a fresh base.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.serving.tiny import DEFAULT_TARGET_MODULES, build_tiny_model, make_peft_adapter

TOL = 1e-5
FAMILIES = ("llama", "qwen2", "mistral")

#: name -> make_peft_adapter keyword arguments; together they cover r, alpha, rsLoRA, targets and patterns.
ADAPTERS: dict[str, dict] = {
    "qv_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=11),
    "all_r8_rslora": dict(r=8, lora_alpha=32, target_modules=list(DEFAULT_TARGET_MODULES), use_rslora=True, seed=12),
    "mlp_r2": dict(r=2, lora_alpha=5, target_modules=["o_proj", "gate_proj", "down_proj"], seed=13),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 2, "down_proj": 6},
        alpha_pattern={"v_proj": 4, "down_proj": 3},
        seed=14,
    ),
    "layer1_up_r1": dict(r=1, lora_alpha=2, target_modules=["up_proj"], layers_to_transform=[1], seed=15),
}

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """family -> adapter name -> directory written by PEFT."""
    out: dict[str, dict[str, Path]] = {}
    for family in FAMILIES:
        base = build_tiny_model(family)
        root = tmp_path_factory.mktemp(f"adapters-{family}")
        out[family] = {name: make_peft_adapter(root / name, family=family, base_model=base, **kw) for name, kw in ADAPTERS.items()}
    return out


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(3))


def peft_logits(family: str, adapter_dir: Path, input_ids: torch.Tensor, device: str, attention_mask=None) -> torch.Tensor:
    ref = PeftModel.from_pretrained(build_tiny_model(family), adapter_dir).to(device).eval()
    mask = None if attention_mask is None else attention_mask.to(device)
    with torch.no_grad():
        return ref(input_ids=input_ids.to(device), attention_mask=mask).logits


def base_logits(family: str, input_ids: torch.Tensor, device: str, attention_mask=None) -> torch.Tensor:
    base = build_tiny_model(family).to(device)
    mask = None if attention_mask is None else attention_mask.to(device)
    with torch.no_grad():
        return base(input_ids=input_ids.to(device), attention_mask=mask).logits


def loaded_model(family: str, dirs: dict[str, Path], device: str) -> MultiLoraModel:
    model = MultiLoraModel(build_tiny_model(family), slots=len(dirs), max_rank=8, device=device)
    for name, path in dirs.items():
        model.promote_lora_from_disk(path, name)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_adapter_matches_peft_model(family: str, device: str, adapter_dirs, input_ids) -> None:
    dirs = adapter_dirs[family]
    model = loaded_model(family, dirs, device)
    for name, path in dirs.items():
        ours = model.forward(input_ids, [name] * input_ids.shape[0])
        ref = peft_logits(family, path, input_ids, device)
        diff = (ours - ref).abs().max().item()
        assert diff <= TOL, f"{family}/{name} on {device}: max abs diff {diff:.3g} > {TOL}"
        # The adapter really changes the output (the parity is not trivially base == base).
        assert (ref - base_logits(family, input_ids, device)).abs().max().item() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_of_three_adapters_and_base_rows_matches_peft_row_by_row(family: str, device: str, adapter_dirs, input_ids) -> None:
    dirs = adapter_dirs[family]
    model = loaded_model(family, dirs, device)
    rows = ["patterns", None, "qv_r4", "all_r8_rslora", None, "patterns"]
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding on a base row and an adapter row
    mask[3, :5] = 0
    ours = model.forward(input_ids, rows, attention_mask=mask)
    base = base_logits(family, input_ids, device, mask)
    refs = {name: peft_logits(family, dirs[name], input_ids, device, mask) for name in set(rows) - {None}}
    for i, name in enumerate(rows):
        ref = base[i] if name is None else refs[name][i]
        keep = mask[i].bool().to(ref.device)  # padded positions carry no meaning
        diff = (ours[i][keep] - ref[keep]).abs().max().item()
        assert diff <= TOL, f"row {i} ({name or 'base'}): max abs diff {diff:.3g}"


@pytest.mark.parametrize("family", ["llama"])
def test_mixed_batch_matches_peft_adapter_names_forward(family: str, adapter_dirs, input_ids) -> None:
    dirs = adapter_dirs[family]
    model = loaded_model(family, dirs, "cpu")
    names = ["qv_r4", "mlp_r2", "patterns"]
    ref = PeftModel.from_pretrained(build_tiny_model(family), dirs[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        ref.load_adapter(dirs[name], adapter_name=name)
    rows = ["qv_r4", "__base__", "mlp_r2", "patterns", "qv_r4", "__base__"]
    with torch.no_grad():
        expected = ref(input_ids=input_ids, adapter_names=rows).logits
    ours = model.forward(input_ids, [None if r == "__base__" else r for r in rows])
    assert (ours - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batches_of_other_sizes_and_ranks_in_turn_match_peft(device: str, adapter_dirs, input_ids) -> None:
    """The gathered A and B of a mixed batch reuse one scratch (``GatherScratch``): batches of 6, 2 and 4 rows, at
    largest rank 8, 2 and 4, one after another, each match PEFT row by row (nothing left over from the one before)."""
    family = "llama"
    dirs = adapter_dirs[family]
    model = loaded_model(family, dirs, device)
    refs = {name: peft_logits(family, path, input_ids, device) for name, path in dirs.items()}
    base = base_logits(family, input_ids, device)
    batches = [
        ["all_r8_rslora", "patterns", None, "qv_r4", "layer1_up_r1", "mlp_r2"],  # rank 8
        ["mlp_r2", None],  # rank 2: smaller views of the same buffers
        ["qv_r4", "mlp_r2", None, "layer1_up_r1"],  # rank 4
        ["patterns", "all_r8_rslora", "qv_r4", None, "mlp_r2", "patterns"],  # rank 8 again, other rows
    ]
    for rows in batches:
        ours = model.forward(input_ids[: len(rows)], rows)
        for i, name in enumerate(rows):
            ref = base[i] if name is None else refs[name][i]
            diff = (ours[i] - ref).abs().max().item()
            assert diff <= TOL, f"{rows}: row {i} ({name or 'base'}) max abs diff {diff:.3g}"
