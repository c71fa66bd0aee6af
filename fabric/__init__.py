"""adapter-fabric: move LoRA adapters between inference nodes and serve them from a slot pool.

What a user needs is importable from here::

    from adapter_fabric import NodeClient, TlsFiles          # talk to nodes (results: StageResult, PromoteResult, Listing, ...)
    from adapter_fabric import MultiLoraModel, ModelAdapters # serve adapters in-process
    from adapter_fabric import AdapterStore, Manifest        # the content-addressed store
    from adapter_fabric import PeftAdapterConfig             # the strict adapter_config.json
    from adapter_fabric import FabricError, PoolFull, ...    # errors a caller can act on

The subpackages are the map for people who change the code: ``format``
(the adapter format), ``store``, ``serving``, ``transport`` (moving bytes),
``rpc`` (the gRPC edge), ``client``, ``cli``, and ``harness`` (test and demo
processes, never on a node's runtime path).

Names that pull in torch or grpc load on first use, so ``import adapter_fabric``
stays cheap for the command line.
"""

from __future__ import annotations

import importlib as _importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING

from adapter_fabric.errors import (
    AdapterNotFound,
    AdaptersUnsupported,
    BadSignature,
    Busy,
    ClientClosed,
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
    NotAMember,
    OriginTooSlow,
    OriginUnavailable,
    PeerUnavailable,
    PermissionDenied,
    PinLimitReached,
    PoolFull,
    QuotaExceeded,
    SlotBusy,
    StoreFull,
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
    "NodeClient": "adapter_fabric.client.node_client",
    # what NodeClient's methods return (adapter_fabric.client.results)
    **dict.fromkeys(
        ("ActiveSlot", "Availability", "GenerateResult", "Identity", "Listing", "Location", "PeerHolding", "PeftSummary",
         "PromoteResult", "SlotInfo", "StagedAdapter", "StageResult", "StoreStatus"),
        "adapter_fabric.client.results",
    ),
    "BulkStageResult": "adapter_fabric.client.bulk",
    "StageFailure": "adapter_fabric.client.bulk",
    "rollout": "adapter_fabric.client.rollout",
    "NodeRollout": "adapter_fabric.client.rollout",
    "TlsFiles": "adapter_fabric.rpc.security",
    "ModelAdapters": "adapter_fabric.serving.adapters",
    "MultiLoraModel": "adapter_fabric.serving.multi_lora",
    "ShapeOnlyModel": "adapter_fabric.serving.shape_only",
    "SlotPool": "adapter_fabric.serving.pool",
    "build_tiny_model": "adapter_fabric.serving.tiny",
    "make_peft_adapter": "adapter_fabric.serving.tiny",
    "AdapterStore": "adapter_fabric.store.adapter_store",
    "Manifest": "adapter_fabric.store.manifest",
    "PeftAdapterConfig": "adapter_fabric.format.config",
}

__all__ = [
    "__version__",
    *_LAZY,
    "AdapterNotFound",
    "AdaptersUnsupported",
    "BadSignature",
    "Busy",
    "ClientClosed",
    "ConfigMismatch",
    "DeadlineExceeded",
    "OriginTooSlow",
    "OriginUnavailable",
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
    "NotAMember",
    "PeerUnavailable",
    "PermissionDenied",
    "PinLimitReached",
    "PoolFull",
    "QuotaExceeded",
    "SlotBusy",
    "StoreFull",
    "StoreMissing",
    "TooManySigners",
    "Unauthenticated",
    "Untrusted",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The public API (``__all__``) and the subpackages loaded so far; not this module's own helpers."""
    loaded = {name for name, value in globals().items() if type(value).__name__ == "module" and not name.startswith("_")}
    return sorted({*__all__, *loaded})


if _TYPE_CHECKING:  # for type checkers and IDEs: the lazy names, eagerly
    from adapter_fabric.client.bulk import BulkStageResult, StageFailure
    from adapter_fabric.client.node_client import NodeClient
    from adapter_fabric.client.results import (
        ActiveSlot,
        Availability,
        GenerateResult,
        Identity,
        Listing,
        Location,
        PeerHolding,
        PeftSummary,
        PromoteResult,
        SlotInfo,
        StagedAdapter,
        StageResult,
        StoreStatus,
    )
    from adapter_fabric.client.rollout import NodeRollout, rollout
    from adapter_fabric.format.config import PeftAdapterConfig
    from adapter_fabric.rpc.security import TlsFiles
    from adapter_fabric.serving.adapters import ModelAdapters
    from adapter_fabric.serving.multi_lora import MultiLoraModel
    from adapter_fabric.serving.pool import SlotPool
    from adapter_fabric.serving.shape_only import ShapeOnlyModel
    from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
    from adapter_fabric.store.adapter_store import AdapterStore
    from adapter_fabric.store.manifest import Manifest
