"""Device choice for the model and the slot pool."""

from __future__ import annotations

import torch

from adapter_fabric.errors import InvalidArgument

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error, not a silent fallback."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InvalidArgument(f"device {spec!r} was asked for but torch sees no CUDA device; use 'auto' or 'cpu'")
        return torch.device(spec)
    if spec == "cpu":
        return torch.device("cpu")
    raise InvalidArgument(f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}")


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU), e.g. before reading a timer."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
