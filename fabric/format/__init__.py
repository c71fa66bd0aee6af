"""The adapter format: strict PEFT config, safetensors header validation, LoRA tensor pairs, content ids."""
