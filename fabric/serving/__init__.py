"""Serving adapters: victim policy, the slot pool, per-row LoRA layers, the ModelAdapters interface and the models."""
