"""adapter-fabric: move LoRA adapters between inference nodes and serve them from a slot pool.

What a user needs is importable from here::

    from fabric import NodeClient, TlsFiles          # talk to nodes (results: StageResult, PromoteResult, Listing, ...)
    from fabric import MultiLoraModel, ModelAdapters # serve adapters in-process
    from fabric import AdapterStore, Manifest        # the content-addressed store
    from fabric import PeftAdapterConfig             # the strict adapter_config.json
    from fabric import FabricError, PoolFull, ...    # errors a caller can act on

The subpackages are the map for people who change the code: ``format``
(the adapter format), ``store``, ``serving``, ``transport`` (moving bytes),
``rpc`` (the gRPC edge), ``client``, ``cli``, and ``harness`` (test and demo
processes, never on a node's runtime path).

Names that pull in torch or grpc load on first use, so ``import fabric``
stays cheap for the command line.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from fabric.errors import (
    AdapterNotFound,
    AdaptersUnsupported,
    BadSignature,
    Busy,
    ConfigMismatch,
    DeadlineExceeded,
    FabricError,
    FieldTooLarge,
    IncompatibleAdapter,
    IncompatibleFormat,
    IntegrityError,
    InvalidAdapter,
    InvalidAdapterId,
    InvalidArgument,
    InvalidConfig,
    InvalidHeader,
    InvalidPolicy,
    InvalidTensors,
    LimitExceeded,
    PeerUnavailable,
    PermissionDenied,
    PinLimitReached,
    PoolFull,
    QuotaExceeded,
    SlotBusy,
    StoreMissing,
    TooManySigners,
    Unauthenticated,
    Untrusted,
)

try:
    __version__: str = _metadata.version("adapter-fabric")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "NodeClient": "fabric.client.node_client",
    "GenerateResult": "fabric.client.results",
    "StageResult": "fabric.client.results",
    "PromoteResult": "fabric.client.results",
    "Listing": "fabric.client.results",
    "StoreStatus": "fabric.client.results",
    "rollout": "fabric.client.rollout",
    "NodeRollout": "fabric.client.rollout",
    "TlsFiles": "fabric.rpc.security",
    "ModelAdapters": "fabric.serving.adapters",
    "MultiLoraModel": "fabric.serving.multi_lora",
    "ShapeOnlyModel": "fabric.serving.shape_only",
    "SlotPool": "fabric.serving.pool",
    "build_tiny_model": "fabric.serving.tiny",
    "make_peft_adapter": "fabric.serving.tiny",
    "AdapterStore": "fabric.store.adapter_store",
    "Manifest": "fabric.store.manifest",
    "PeftAdapterConfig": "fabric.format.config",
}

__all__ = [
    "__version__",
    *_LAZY,
    "AdapterNotFound",
    "AdaptersUnsupported",
    "BadSignature",
    "Busy",
    "ConfigMismatch",
    "DeadlineExceeded",
    "FabricError",
    "FieldTooLarge",
    "IncompatibleAdapter",
    "IncompatibleFormat",
    "IntegrityError",
    "InvalidAdapter",
    "InvalidAdapterId",
    "InvalidArgument",
    "InvalidConfig",
    "InvalidHeader",
    "InvalidPolicy",
    "InvalidTensors",
    "LimitExceeded",
    "PeerUnavailable",
    "PermissionDenied",
    "PinLimitReached",
    "PoolFull",
    "QuotaExceeded",
    "SlotBusy",
    "StoreMissing",
    "TooManySigners",
    "Unauthenticated",
    "Untrusted",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # for type checkers and IDEs: the lazy names, eagerly
    from fabric.client.node_client import NodeClient
    from fabric.client.results import GenerateResult, Listing, PromoteResult, StageResult, StoreStatus
    from fabric.client.rollout import NodeRollout, rollout
    from fabric.format.config import PeftAdapterConfig
    from fabric.rpc.security import TlsFiles
    from fabric.serving.adapters import ModelAdapters
    from fabric.serving.multi_lora import MultiLoraModel
    from fabric.serving.pool import SlotPool
    from fabric.serving.shape_only import ShapeOnlyModel
    from fabric.serving.tiny import build_tiny_model, make_peft_adapter
    from fabric.store.adapter_store import AdapterStore
    from fabric.store.manifest import Manifest
