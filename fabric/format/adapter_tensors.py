"""Check that a safetensors index is a PEFT LoRA adapter that matches its config.

PEFT's ``save_pretrained`` writes, for each adapted linear layer ``<module>``
(its path inside the base model, e.g. ``model.layers.0.self_attn.q_proj``),
exactly two tensors::

    base_model.model.<module>.lora_A.weight   (rank, in_features)
    base_model.model.<module>.lora_B.weight   (out_features, rank)

Anything else (a bias, DoRA's ``lora_magnitude_vector``, embedding adapters,
``modules_to_save`` copies) would change the output in a way this project does
not compute, so it is refused by name rather than ignored. Only the header is
needed: no tensor is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter_fabric.errors import InvalidTensors
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.safetensors_index import SafetensorsIndex, TensorInfo

PREFIX = "base_model.model."
SUFFIX_A = ".lora_A.weight"
SUFFIX_B = ".lora_B.weight"
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_SHOWN = 5  # how many offending names a message lists


@dataclass(frozen=True)
class LoraPair:
    module: str  # the model's module path, e.g. "model.layers.0.self_attn.q_proj"
    rank: int
    in_features: int
    out_features: int
    a: TensorInfo  # lora_A: (rank, in_features)
    b: TensorInfo  # lora_B: (out_features, rank)


def tensor_names(module: str) -> tuple[str, str]:
    """The lora_A and lora_B tensor names PEFT writes for a module."""
    return f"{PREFIX}{module}{SUFFIX_A}", f"{PREFIX}{module}{SUFFIX_B}"


def lora_pairs(index: SafetensorsIndex, config: PeftAdapterConfig) -> dict[str, LoraPair]:
    """The adapter's (A, B) pairs keyed by module, sorted by module name; refuses anything else."""
    if not index.tensors:
        raise InvalidTensors("the adapter holds no tensors: a LoRA adapter has a lora_A and lora_B per module")
    halves = _split_names(index)
    pairs: dict[str, LoraPair] = {}
    for module in sorted(halves):
        pair = _pair(module, halves[module])
        _check_against_config(pair, config)
        pairs[module] = pair
    return pairs


# ---------------------------------------------------------------- helpers


def _parse_name(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` for a PEFT LoRA weight name, else None."""
    if not name.startswith(PREFIX):
        return None
    for suffix, half in ((SUFFIX_A, "A"), (SUFFIX_B, "B")):
        if name.endswith(suffix):
            module = name[len(PREFIX) : -len(suffix)]
            if module and not module.startswith(".") and not module.endswith("."):
                return module, half
    return None


def _split_names(index: SafetensorsIndex) -> dict[str, dict[str, TensorInfo]]:
    halves: dict[str, dict[str, TensorInfo]] = {}
    unexpected: list[str] = []
    for info in index.tensors:
        parsed = _parse_name(info.name)
        if parsed is None:
            unexpected.append(info.name)
            continue
        if info.dtype not in FLOAT_DTYPES:
            raise InvalidTensors(
                f"tensor {info.name!r} has dtype {info.dtype}; LoRA weights must be one of {', '.join(sorted(FLOAT_DTYPES))}"
            )
        module, half = parsed
        halves.setdefault(module, {})[half] = info
    if unexpected:
        shown = ", ".join(repr(n) for n in sorted(unexpected)[:_SHOWN])
        more = f" (+{len(unexpected) - _SHOWN} more)" if len(unexpected) > _SHOWN else ""
        raise InvalidTensors(
            f"{len(unexpected)} tensor(s) are not PEFT LoRA weights "
            f"({PREFIX}<module>{SUFFIX_A} / {SUFFIX_B}): {shown}{more}; "
            "biases, DoRA magnitudes, embedding adapters and saved modules are not supported"
        )
    return halves


def _pair(module: str, halves: dict[str, TensorInfo]) -> LoraPair:
    name_a, name_b = tensor_names(module)
    for half, name in (("A", name_a), ("B", name_b)):
        if half not in halves:
            other = "B" if half == "A" else "A"
            raise InvalidTensors(f"module {module!r}: lora_{half} is missing ({name!r}); lora_{other} is present")
    a, b = halves["A"], halves["B"]
    for info, layout in ((a, "(rank, in_features)"), (b, "(out_features, rank)")):
        if len(info.shape) != 2:
            raise InvalidTensors(
                f"module {module!r}: tensor {info.name!r} has shape {list(info.shape)} ({len(info.shape)}-D); "
                f"it must be 2-D {layout}"
            )
    if a.shape[0] != b.shape[1]:
        raise InvalidTensors(
            f"module {module!r}: rank mismatch between lora_A shape {list(a.shape)} (rank {a.shape[0]}) "
            f"and lora_B shape {list(b.shape)} (rank {b.shape[1]})"
        )
    return LoraPair(module=module, rank=a.shape[0], in_features=a.shape[1], out_features=b.shape[0], a=a, b=b)


def _check_against_config(pair: LoraPair, config: PeftAdapterConfig) -> None:
    if not config.targets(pair.module):
        raise InvalidTensors(
            f"module {pair.module!r} has LoRA tensors but the config does not target it ({config.describe()})"
        )
    expected = config.rank_for(pair.module)
    if pair.rank != expected:
        raise InvalidTensors(
            f"module {pair.module!r}: tensors have rank {pair.rank} but the config gives rank {expected} "
            f"for it (r={config.r}, rank_pattern={dict(config.rank_pattern)})"
        )
