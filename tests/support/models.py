"""What a node's model answers, computed in the test process with PEFT itself (no node needed for the reference)."""

from __future__ import annotations

from pathlib import Path

PROMPT = [3, 14, 15, 92, 65, 35]


def reference_logits(adapter_dir: Path, prompt: list[int] = PROMPT) -> list[float]:
    """The last position's logits of ``PeftModel`` over the built-in tiny model with ``adapter_dir`` loaded."""
    import torch
    from peft import PeftModel

    from adapter_fabric.serving.tiny import build_tiny_model

    model = PeftModel.from_pretrained(build_tiny_model(), adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].tolist()
