"""Adapters handed to inference engines: the vLLM LoRA resolver (``vllm_resolver``).

SGLang needs no code: it loads an exported directory through its
``/load_lora_adapter`` API (see the README's engine integrator section).
"""
