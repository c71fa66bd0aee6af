"""An empty stand-in for torchvision, for SGLang's imports on CPU (see tests/support/sglang_probe.py).

The only torchvision build served is a CUDA one, and installing it replaces the CPU torch; SGLang's
HTTP server imports torchvision at module level (multimodal configs) but its LoRA path never uses it.
"""
