"""The names SGLang imports from torchvision.transforms at module level (nothing more)."""

from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
