"""Origins: where adapters live before the fabric holds them (S3, the Hugging Face Hub, HTTP, a directory).

A node started with ``--origin URI`` (repeatable, tried in order) fetches a miss the cluster cannot serve
from its origins, stages it like any Stage (every check, committed by content), and serves it to peers.

How an adapter id maps to an origin's files:

    s3://bucket/prefix       s3://bucket/prefix/<id>/adapter_config.json and .../<id>/adapter_model.safetensors
    https://host/prefix      https://host/prefix/<id>/adapter_config.json and .../<id>/adapter_model.safetensors
    file:///path             /path/<id>/adapter_config.json and /path/<id>/adapter_model.safetensors
    hf://  (hf://ORG)        the model repo <id> = org/name (ORG's only): its root adapter_config.json and
                             adapter_model.safetensors, as PEFT's push_to_hub writes them

``<id>@<revision>`` (``adapter_fabric.store.ids``) pins a revision: a Hub commit (or branch or tag, resolved
once), an S3 VersionId or ETag, an HTTP ETag, or an adapter digest; it never moves.

Modules: ``base`` (the protocol, revisions, limits), ``bounded`` (size caps and the deadline while bytes
arrive), ``uri`` (parsing --origin), one module per kind, ``records`` (each id's revision record).
"""
