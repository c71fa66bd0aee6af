"""adapter-fabric: move LoRA adapters between inference nodes and serve them from a slot pool."""
