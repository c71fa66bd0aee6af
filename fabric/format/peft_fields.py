"""The PEFT fields of the wire contract: built from a staged config, and checked against a caller's.

A promote may carry the PEFT settings the caller expects (rank, alpha,
rsLoRA, targets, patterns). Each field it sets must agree with the staged
config; an unset field means "whatever was staged". A disagreement is an error
naming the field and both values, so a wrong adapter id never loads silently.
"""

from __future__ import annotations

import math

from adapter_fabric.errors import ConfigMismatch
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.v1 import fabric_pb2


def peft_fields_of(config: PeftAdapterConfig) -> fabric_pb2.PeftFields:
    fields = fabric_pb2.PeftFields(r=config.r, lora_alpha=float(config.lora_alpha), use_rslora=config.use_rslora)
    if isinstance(config.target_modules, str):
        fields.target_modules_pattern = config.target_modules
    else:
        fields.target_modules.extend(config.target_modules)
    fields.rank_pattern.update({k: int(v) for k, v in config.rank_pattern.items()})
    fields.alpha_pattern.update({k: float(v) for k, v in config.alpha_pattern.items()})
    return fields


def check_agrees(requested: fabric_pb2.PeftFields | None, config: PeftAdapterConfig, adapter_id: str) -> None:
    """Raise ConfigMismatch naming the first field where the caller and the staged config differ."""
    if requested is None:
        return
    differences: list[str] = []
    if requested.HasField("r") and requested.r != config.r:
        differences.append(f"r: asked {requested.r}, staged {config.r}")
    if requested.HasField("lora_alpha") and not math.isclose(requested.lora_alpha, float(config.lora_alpha), rel_tol=1e-9):
        differences.append(f"lora_alpha: asked {requested.lora_alpha:g}, staged {float(config.lora_alpha):g}")
    if requested.HasField("use_rslora") and requested.use_rslora != config.use_rslora:
        differences.append(f"use_rslora: asked {requested.use_rslora}, staged {config.use_rslora}")
    staged = peft_fields_of(config)
    if requested.target_modules and sorted(set(requested.target_modules)) != sorted(staged.target_modules):
        differences.append(f"target_modules: asked {sorted(set(requested.target_modules))}, staged {list(staged.target_modules) or staged.target_modules_pattern}")
    if requested.target_modules_pattern and requested.target_modules_pattern != staged.target_modules_pattern:
        differences.append(f"target_modules: asked {requested.target_modules_pattern!r}, staged {list(staged.target_modules) or staged.target_modules_pattern!r}")
    if requested.rank_pattern and dict(requested.rank_pattern) != dict(staged.rank_pattern):
        differences.append(f"rank_pattern: asked {dict(requested.rank_pattern)}, staged {dict(staged.rank_pattern)}")
    if requested.alpha_pattern and dict(requested.alpha_pattern) != dict(staged.alpha_pattern):
        differences.append(f"alpha_pattern: asked {dict(requested.alpha_pattern)}, staged {dict(staged.alpha_pattern)}")
    if differences:
        raise ConfigMismatch(
            f"the PEFT settings given for {adapter_id!r} disagree with its staged config: "
            + "; ".join(differences)
            + " (omit them to use the staged config, or promote the adapter that has them)"
        )
