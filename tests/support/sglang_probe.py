"""Import SGLang's own HTTP server and LoRA code on CPU and print what loaded, as JSON.

    python tests/support/sglang_probe.py

``load_sglang()`` is the set-up a test of the SGLang hand-off starts from:
transformers is asked about torchvision first (it caches the answer: none),
then the empty stand-in in tests/support/sglang_standin is put on sys.path
for SGLang's module-level ``import torchvision.transforms``. Without the
first step transformers would see the stand-in and import parts of
torchvision it does not have.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

STANDIN = Path(__file__).resolve().parent / "sglang_standin"


def load_sglang() -> dict[str, ModuleType]:
    """SGLang's HTTP server, TokenizerManager, LoRARegistry and LoRAManager modules, imported on CPU."""
    import importlib

    from transformers.utils import import_utils

    if not import_utils.is_torchvision_available() and str(STANDIN) not in sys.path:  # a real one needs none
        sys.path.insert(0, str(STANDIN))
    names = ["sglang.srt.entrypoints.http_server", "sglang.srt.managers.tokenizer_manager", "sglang.srt.lora.lora_registry", "sglang.srt.lora.lora_manager"]
    return {name: importlib.import_module(name) for name in names}


def main() -> None:
    import importlib.metadata

    import torch

    modules = load_sglang()
    server = modules["sglang.srt.entrypoints.http_server"]
    routes = sorted(getattr(route, "path", "") for route in server.app.routes)
    print(json.dumps({
        "sglang": importlib.metadata.version("sglang"),
        "torch": torch.__version__,
        "lora_routes": [r for r in routes if "lora" in r or r == "/v1/models"],
        "classes": ["TokenizerManager" if hasattr(modules["sglang.srt.managers.tokenizer_manager"], "TokenizerManager") else "",
                    "LoRARegistry" if hasattr(modules["sglang.srt.lora.lora_registry"], "LoRARegistry") else "",
                    "LoRAManager" if hasattr(modules["sglang.srt.lora.lora_manager"], "LoRAManager") else ""],
    }))


if __name__ == "__main__":
    main()
