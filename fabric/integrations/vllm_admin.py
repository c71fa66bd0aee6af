"""vLLM's runtime LoRA route the node uses when an id moves: ``POST /v1/unload_lora_adapter {"lora_name": NAME}``.

vLLM (0.8.5 to 0.34.0 read) keeps each LoRA by name in ``OpenAIServingModels.lora_requests``; a request naming
a name it holds is served from that ``LoRARequest`` and never reaches a resolver again. Unloading the name
(the route exists when vLLM runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``) drops that entry, so the next
request resolves the name afresh: the fabric's resolver then answers the id's new digest, from a path named by
that digest, under a new ``lora_int_id`` (vLLM numbers each resolve). vLLM's prefix cache keys a LoRA's blocks
by (name, path) (``kv_cache_utils._gen_lora_extra_hash_keys``), so no block computed with the old weights
matches a request for the new ones. 200: unloaded; 404: it did not hold the name; anything else is named.
"""

from __future__ import annotations

import json

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.integrations.engine_http import exchange
from adapter_fabric.integrations.engine_models import engine_label

#: bound on one unload call (vLLM answers from its API process at once)
UNLOAD_TIMEOUT_S = 10.0
MAX_REPLY_BYTES = 64 << 10


def unload_lora(url: str, name: str, timeout: float = UNLOAD_TIMEOUT_S) -> bool:
    """Unload ``name`` from the vLLM at ``url``; False when it did not hold it. ``PeerUnavailable`` when it does not answer,
    ``InvalidArgument`` when it refuses (a vLLM without runtime LoRA updating answers 404 for the route itself: named)."""
    body = exchange(
        f"{url}/v1/unload_lora_adapter", "POST /v1/unload_lora_adapter", engine_label(url), timeout, MAX_REPLY_BYTES,
        body=json.dumps({"lora_name": name}).encode(), headers={"Content-Type": "application/json", "Accept": "application/json"},
        accept=(400, 404, 405),
    )  # fmt: skip
    text = body[:MAX_REPLY_BYTES].decode(errors="replace")
    try:
        answer = json.loads(text)
    except ValueError:
        return True  # vLLM answers a success as plain text ("Success: LoRA adapter ... removed successfully.")
    if not isinstance(answer, dict):
        return True
    error: dict = answer["error"] if isinstance(answer.get("error"), dict) else answer
    message = str(error.get("message") or error.get("detail") or "")[:300]
    if "cannot be found" in message:
        return False
    if str(error.get("detail", "")) == "Not Found" or answer.get("detail") == "Not Found":
        raise InvalidArgument(
            f"engine {engine_label(url)} has no POST /v1/unload_lora_adapter: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true "
            f"so the node can make it drop an adapter whose id moved"
        )
    raise InvalidArgument(f"engine {engine_label(url)} refused to unload {name!r}: {message}")
