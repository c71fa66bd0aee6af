"""Adapters handed to inference engines: the vLLM LoRA resolver (``vllm_resolver``), what an engine registered
(``engine_models``), and the client and plan that drive an SGLang server's LoRA registry (``sglang``).
"""
