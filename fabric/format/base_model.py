"""Whether an adapter is for the model a node or an engine serves: its ``base_model_name_or_path`` against the model's names.

One rule for the node (a promote, ``--model`` and ``--base-model``) and the vLLM plugin (vLLM's served
model name and ``FABRIC_BASE_MODEL``), written the way operators name models:

- an adapter that names no base model claims nothing, and matches;
- names compare without case, and either whole or by their last part: a hub id's model name
  (``meta-llama/Llama-3.1-8B-Instruct`` -> ``Llama-3.1-8B-Instruct``) or a directory's name
  (``/models/Llama-3.1-8B-Instruct``); a Hugging Face cache path
  (``.../models--meta-llama--Llama-3.1-8B-Instruct/snapshots/<hash>``) goes by the model it caches;
- so ``meta-llama/Llama-3.1-8B-Instruct`` matches a model served as ``/models/llama-3.1-8b-instruct`` or
  ``--served-model-name Llama-3.1-8B-Instruct``, while a model mounted under another name (``/models/base``)
  needs that name said once: ``--base-model`` on a node, ``FABRIC_BASE_MODEL`` for the plugin (or vLLM's
  ``--served-model-name``).

Pure: strings in, a verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: a Hugging Face hub cache directory: models--ORG--NAME
_HUB_CACHE = re.compile(r"models--(?:(?P<org>.+?)--)?(?P<name>[^/]+)")


def name_forms(name: str) -> set[str]:
    """Every form ``name`` goes by, folded: the whole, its last part, and the model a hub cache path holds."""
    name = name.strip().rstrip("/")
    if not name:
        return set()
    parts = [p for p in name.split("/") if p]
    forms = {name.casefold(), parts[-1].casefold()} if parts else {name.casefold()}
    for part in parts:
        cached = _HUB_CACHE.fullmatch(part)
        if cached:
            forms.add(cached["name"].casefold())
            if cached["org"]:
                forms.add(f"{cached['org']}/{cached['name']}".casefold())
    return forms


def base_model_matches(adapter_base: str | None, names: Iterable[str]) -> bool:
    """Whether an adapter naming ``adapter_base`` is for a model that goes by ``names`` (see the module's rules)."""
    if not adapter_base or not adapter_base.strip():
        return True
    wanted = name_forms(adapter_base)
    return any(wanted & name_forms(name) for name in names if name)
