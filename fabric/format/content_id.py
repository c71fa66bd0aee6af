"""Content-derived adapter ids: the u64 a prefix cache keys on.

Two adapters get the same id exactly when they hold the same bytes and the same
per-module scaling, so every node computes the same id for the same adapter and
a name reloaded with new contents gets a new id (a stale prefix cache entry can
never be reused). 0 is reserved for the base model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from adapter_fabric.format.config import PeftAdapterConfig


def content_id(weights_root: str, config: PeftAdapterConfig, modules: Iterable[str]) -> int:
    """A non-zero u64 from the safetensors file's root (``adapter_fabric.store.digests``) and the scaling of every adapted module."""
    scaling = {module: repr(float(config.scaling_for(module))) for module in sorted(set(modules))}
    material = json.dumps({"weights_root": weights_root, "scaling": scaling}, sort_keys=True)
    value = int.from_bytes(hashlib.sha256(b"adapter-fabric content id v2\0" + material.encode()).digest()[:8], "big")
    return value or 1
