"""``PeftAdapterConfig``: a strict parse of PEFT's ``adapter_config.json``.

Parsing validates on construction (as PEFT's own ``LoraConfig`` does): every
setting that would change the adapter's output and that this project does not
implement is refused by name, so an adapter never loads and silently computes
something else. Settings that only matter for training or initialisation are
ignored. A key this parser does not know is accepted only when it holds a
neutral value (null, false, empty), so a newer PEFT that adds inert keys still
parses, while a newer feature that is switched on is refused.

Module matching follows PEFT 0.21 (``check_target_module_exists`` and
``get_pattern_key``) so per-module rank and scaling agree with ``PeftModel``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapter_fabric.errors import InvalidConfig

CONFIG_FILE = "adapter_config.json"
ALL_LINEAR = "all-linear"

# Keys this project reads.
_USED = {
    "peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layers_pattern", "base_model_name_or_path", "task_type", "exclude_modules",
}
# Keys that only matter for training, initialisation or bookkeeping.
_IGNORED = {
    "auto_mapping", "revision", "inference_mode", "init_lora_weights", "lora_dropout", "peft_version",
    "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "ensure_weight_tying",
}
# Keys that change the output: each must hold the value PEFT writes when the feature is off.
_MUST_BE_OFF: dict[str, str] = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA bias terms",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "modules_to_save": "fully trained extra modules",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on nn.Parameter targets",
    "layer_replication": "layer replication",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "alora_invocation_tokens": "activated LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


@dataclass(frozen=True)
class PeftAdapterConfig:
    """The settings of a LoRA adapter that decide its output."""

    r: int
    lora_alpha: float
    #: a tuple of module-name suffixes, or a regex matched against the full module name, or "all-linear"
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    base_model_name_or_path: str | None = None
    task_type: str | None = None

    def __post_init__(self) -> None:
        _check_rank("r", self.r)
        _check_alpha("lora_alpha", self.lora_alpha)
        for key, rank in self.rank_pattern.items():
            _check_rank(f"rank_pattern[{key!r}]", rank)
        for key, alpha in self.alpha_pattern.items():
            _check_alpha(f"alpha_pattern[{key!r}]", alpha)
        for name, patterns in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for key in patterns:
                _check_regex(f"{name} key", key)
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                _check_regex("target_modules", self.target_modules)
            if self.layers_to_transform is not None:
                # PEFT refuses this pair too: a pattern target ignores the layer limit.
                raise InvalidConfig(
                    f"layers_to_transform={list(self.layers_to_transform)!r} cannot be combined with target_modules={self.target_modules!r}; "
                    "list the module names instead"
                )
        elif not self.target_modules:
            raise InvalidConfig("target_modules is empty: the adapter targets no module")

    # ------------------------------------------------------------- parsing

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PeftAdapterConfig:
        if not isinstance(raw, Mapping):
            raise InvalidConfig(f"{CONFIG_FILE} must hold a JSON object, not {type(raw).__name__}")
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidConfig(f"peft_type={peft_type!r} is not supported: only LORA adapters can be served")
        for key, feature in _MUST_BE_OFF.items():
            value = raw.get(key)
            if not _is_neutral(value):
                raise InvalidConfig(f"{key}={value!r} is not supported ({feature} would change the output)")
        bias = raw.get("bias", "none")
        if bias != "none":
            raise InvalidConfig(f"bias={bias!r} is not supported: only bias='none' adapters can be served")
        for key, value in raw.items():
            if key not in _USED and key not in _IGNORED and key not in _MUST_BE_OFF and key != "bias":
                if not _is_neutral(value):
                    raise InvalidConfig(f"unknown setting {key}={value!r}: this PEFT feature is not supported")

        if "r" not in raw:
            raise InvalidConfig("r is missing: the adapter's rank is required")
        if "target_modules" not in raw or raw["target_modules"] is None:
            raise InvalidConfig("target_modules is missing: the adapter must name the modules it adapts")
        return cls(
            r=raw["r"],
            lora_alpha=raw.get("lora_alpha", 8),
            target_modules=_parse_targets("target_modules", raw["target_modules"]),
            use_rslora=_parse_bool("use_rslora", raw.get("use_rslora", False)),
            rank_pattern=_parse_pattern("rank_pattern", raw.get("rank_pattern")),
            alpha_pattern=_parse_pattern("alpha_pattern", raw.get("alpha_pattern")),
            layers_to_transform=_parse_layers(raw.get("layers_to_transform")),
            layers_pattern=_parse_layers_pattern(raw.get("layers_pattern")),
            exclude_modules=_parse_targets("exclude_modules", raw["exclude_modules"])
            if raw.get("exclude_modules")
            else None,
            base_model_name_or_path=_parse_optional_str("base_model_name_or_path", raw.get("base_model_name_or_path")),
            task_type=_parse_optional_str("task_type", raw.get("task_type")),
        )

    @classmethod
    def from_json_bytes(cls, data: bytes) -> PeftAdapterConfig:
        try:
            raw = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidConfig(f"{CONFIG_FILE} is not valid UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise InvalidConfig(f"{CONFIG_FILE} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dir(cls, adapter_dir: str | Path) -> PeftAdapterConfig:
        path = Path(adapter_dir) / CONFIG_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InvalidConfig(f"{path} does not exist: a PEFT adapter directory holds {CONFIG_FILE}") from None
        return cls.from_json_bytes(data)

    # ------------------------------------------------------------- modules

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would put LoRA on the linear layer with this full name.

        ``all-linear`` matches every name here; the caller decides which modules
        are linear (and leaves the output head out, as PEFT does).
        """
        if self.exclude_modules and _matches(self.exclude_modules, module_name):
            return False
        if self.target_modules == ALL_LINEAR:
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        if not _matches(self.target_modules, module_name):
            return False
        if self.layers_to_transform is None:
            return True
        index = _layer_index(module_name, self.layers_pattern)
        return index is not None and index in self.layers_to_transform

    def rank_for(self, module_name: str) -> int:
        """The LoRA rank of one module (``rank_pattern`` over ``r``)."""
        key = _pattern_key(self.rank_pattern, module_name)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module_name: str) -> float:
        """The LoRA alpha of one module (``alpha_pattern`` over ``lora_alpha``)."""
        key = _pattern_key(self.alpha_pattern, module_name)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scaling_for(self, module_name: str) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, for this module's own r and alpha."""
        rank = self.rank_for(module_name)
        alpha = self.alpha_for(module_name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def max_rank(self) -> int:
        """The largest rank of any module."""
        return max([self.r, *self.rank_pattern.values()])

    # ------------------------------------------------------------- output

    def to_lora_config(self):
        """The equivalent ``peft.LoraConfig`` (for PEFT reference runs and round trips)."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        exclude = self.exclude_modules if isinstance(self.exclude_modules, (str, type(None))) else list(self.exclude_modules)
        return LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            target_modules=targets,
            exclude_modules=exclude,
            use_rslora=self.use_rslora,
            rank_pattern=dict(self.rank_pattern),
            alpha_pattern=dict(self.alpha_pattern),
            layers_to_transform=list(self.layers_to_transform) if self.layers_to_transform is not None else None,
            layers_pattern=list(self.layers_pattern) if self.layers_pattern is not None else None,
            base_model_name_or_path=self.base_model_name_or_path,
            task_type=self.task_type,
            bias="none",
        )

    @classmethod
    def from_lora_config(cls, config) -> PeftAdapterConfig:
        """Parse a ``peft.LoraConfig`` through the same strict path as a file."""
        return cls.from_dict(json.loads(json.dumps(config.to_dict(), default=_jsonable)))

    def describe(self) -> str:
        """A one-line summary for logs and errors."""
        targets = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        extra = " rslora" if self.use_rslora else ""
        if self.rank_pattern:
            extra += f" rank_pattern={dict(self.rank_pattern)}"
        if self.alpha_pattern:
            extra += f" alpha_pattern={dict(self.alpha_pattern)}"
        return f"r={self.r} alpha={self.lora_alpha:g} targets={targets}{extra}"


# ---------------------------------------------------------------- helpers


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums such as TaskType / PeftType
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _check_rank(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{key}={value!r} must be a positive integer")
    if value <= 0:
        raise InvalidConfig(f"{key}={value!r} must be a positive integer (r <= 0 has no LoRA update)")


def _check_alpha(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"{key}={value!r} must be a finite positive number")
    if not math.isfinite(value) or value <= 0:
        raise InvalidConfig(f"{key}={value!r} must be a finite positive number")


def _check_regex(key: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise InvalidConfig(f"{key}={pattern!r} is not a valid regular expression: {exc}") from None


def _parse_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{key}={value!r} must be true or false")
    return value


def _parse_optional_str(key: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidConfig(f"{key}={value!r} must be a string or null")
    return value


def _parse_targets(key: str, value: Any) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        # PEFT stores a set: the order in the file carries no meaning.
        return tuple(sorted(set(value)))
    raise InvalidConfig(f"{key}={value!r} must be a list of module names, a regex string or 'all-linear'")


def _parse_pattern(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidConfig(f"{key}={value!r} must be an object mapping module patterns to values")
    return dict(value)


def _parse_layers(value: Any) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    raise InvalidConfig(f"layers_to_transform={value!r} must be a non-negative layer index or a list of them")


def _parse_layers_pattern(value: Any) -> tuple[str, ...] | None:
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidConfig(f"layers_pattern={value!r} must be a string or a list of strings")


def _matches(names: tuple[str, ...] | str, module_name: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, module_name) is not None
    return module_name in names or module_name.endswith(_dotted(tuple(names)))


@functools.lru_cache(maxsize=64)
def _dotted(names: tuple[str, ...]) -> tuple[str, ...]:
    """``.name`` of each name, for one ``endswith`` per module (a manifest asks for each of its hundreds of modules)."""
    return tuple(f".{n}" for n in names)


def _pattern_key(patterns: Mapping[str, Any], module_name: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern that matches a suffix of the name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def _layer_index(module_name: str, layers_pattern: tuple[str, ...] | None) -> int | None:
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_name)
            if match is not None:
                break
    return int(match.group("idx")) if match else None
