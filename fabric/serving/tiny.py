"""Built-in tiny base models and PEFT adapters made in code (nothing is downloaded).

Every node that builds ``tiny`` gets bit-identical weights: the initialisation
is seeded and runs in a forked RNG so it neither depends on nor disturbs the
caller's random state. The demo, the tests and the benchmarks all use these.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.serving.names import DEFAULT_TARGET_MODULES as DEFAULT_TARGET_MODULES  # re-exported: the tiny models adapt these

_TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

#: model spec -> transformers family; "tiny" is the Llama one.
TINY_PRESETS = {"tiny": "llama", "tiny-llama": "llama", "tiny-mistral": "mistral", "tiny-qwen2": "qwen2"}


def tiny_config(family: str = "llama"):
    """A small transformers config of the given family (llama, mistral, qwen2)."""
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**_TINY_SHAPE)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**_TINY_SHAPE, sliding_window=None)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**_TINY_SHAPE, use_sliding_window=False)
    raise InvalidArgument(f"unknown tiny model family {family!r}; known: llama, mistral, qwen2")


def build_tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A seeded, eval-mode causal LM of the given tiny family."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_base_model(spec: str, dtype: torch.dtype = torch.float32):
    """``tiny`` (or ``tiny-mistral``, ``tiny-qwen2``) or a local transformers model directory."""
    if spec in TINY_PRESETS:
        return build_tiny_model(TINY_PRESETS[spec], dtype=dtype)
    path = Path(spec)
    if not path.is_dir():
        known = ", ".join(sorted(TINY_PRESETS))
        raise InvalidArgument(f"model {spec!r} is neither a preset ({known}) nor a local model directory")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


def make_peft_adapter(
    out_dir: str | Path,
    *,
    family: str = "llama",
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: Iterable[str] | str = ("q_proj", "v_proj"),
    seed: int = 1,
    base_model=None,
    **lora_kwargs: Any,
) -> Path:
    """Write a real PEFT LoRA adapter with ``save_pretrained`` and return its directory.

    ``init_lora_weights=False`` makes both A and B random, so the adapter
    changes the output (PEFT's default leaves B at zero). Extra keyword
    arguments go to ``peft.LoraConfig`` (``use_rslora``, ``rank_pattern``, ...).
    """
    from peft import LoraConfig, get_peft_model

    base = base_model if base_model is not None else build_tiny_model(family)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    # PEFT annotates lora_alpha as int; it takes a float (scaling = alpha / r)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, init_lora_weights=False, **lora_kwargs)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing: a notice to PEFT, not to whoever makes an adapter
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, config)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    # get_peft_model wrapped the base in place; undo it so a shared base stays clean.
    peft_model.unload()
    sort_target_modules(out / "adapter_config.json")
    return out


def sort_target_modules(config_path: Path) -> None:
    """Write ``target_modules`` sorted: PEFT keeps them as a set, so their order in the file followed the process's string
    hashing, and the same weights got a different config, hence a different digest, from one run to the next."""
    config = json.loads(config_path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
