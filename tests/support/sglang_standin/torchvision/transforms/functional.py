"""torchvision.transforms.functional's InterpolationMode: SGLang's multimodal configs import it at module level."""

import enum


class InterpolationMode(enum.Enum):
    """The members SGLang's multimodal configs name."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
