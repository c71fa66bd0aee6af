"""What each fabric.v1 RPC needs: the verb, and the ids (or digests) its request names. One table, read by ``adapter_fabric.node.gate``.

| RPC | verb | on |
|---|---|---|
| Stage, UploadOffset | publish | the id (Stage: its first message, the StageBegin) |
| StageMany | publish | some prefix for the call; each adapter's id as it comes (``adapter_fabric.node.stage_many``), a refusal that adapter's |
| Unstage | unstage | the id |
| Keep, Pin, SetActive | operate | the id or the slot's name |
| Promote | operate | the id, and the name it loads under (the bytes are pulled for the caller: ``node.promotes.pull_authority``) |
| GetManifest | read | the id (describing an adapter) |
| Fetch, Availability | pull | the id, or the ids that refer to the digest |
| Locate | read | the id, or the ids that refer to the digest |
| Announce | pull | the id (a holder of an id says so to its homes: only a member, as it names itself, is kept) |
| Generate | read | the named adapter; the base model: read anywhere; the active adapter (unnamed): read on ``*`` |
| ListAdapters, StoreStatus | read | what the caller may read: the answer is filtered (``adapter_fabric.access.caller``) |
| WhoAmI | none | the caller's own principal |

An RPC missing from the table is refused to every principal but one holding
``admin`` on ``*``: a method added later is closed until it has a rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapter_fabric.v1 import fabric_pb2


@dataclass(frozen=True)
class Need:
    """What one call needs. No ids and no digests: the verb on some prefix (``everywhere``: on ``*``)."""

    verb: str | None  # None: any known principal may call it
    ids: tuple[str, ...] = ()
    digests: tuple[str, ...] = ()
    everywhere: bool = False


def _on_id(verb: str, field: str = "adapter_id") -> Callable[[Any], Need]:
    return lambda request: Need(verb, ids=(getattr(request, field),))


def _id_or_digest(verb: str) -> Callable[[Any], Need]:
    # the digest is what the group uses when both are given (node.peer_reads)
    return lambda request: Need(verb, digests=(request.digest,)) if request.digest else Need(verb, ids=(request.adapter_id,))


def _stage(first: fabric_pb2.StageRequest) -> Need:
    # a stream that does not begin with its StageBegin is refused by the group, before the store is touched
    return Need("publish", ids=(first.begin.adapter_id,)) if first.WhichOneof("kind") == "begin" else Need("publish")


def _promote(request: fabric_pb2.PromoteRequest) -> Need:
    names = (request.adapter_id,) if not request.name or request.name == request.adapter_id else (request.adapter_id, request.name)
    return Need("operate", ids=names)


def _generate(request: fabric_pb2.GenerateRequest) -> Need:
    if request.use_base or request.adapter == "base":
        return Need("read")
    if not request.adapter:
        return Need("read", everywhere=True)  # the active adapter may be anyone's
    return Need("read", ids=(request.adapter,))


#: method name -> what its request needs (Stage: its first message)
RULES: dict[str, Callable[[Any], Need]] = {
    "Stage": _stage,
    "StageMany": lambda request: Need("publish"),
    "UploadOffset": _on_id("publish"),
    "Unstage": _on_id("unstage"),
    "Keep": _on_id("operate"),
    "Pin": _on_id("operate", "name"),
    "SetActive": _on_id("operate", "name"),
    "Promote": _promote,
    "GetManifest": _on_id("read"),
    "Fetch": _id_or_digest("pull"),
    "Availability": lambda request: Need("pull", digests=(request.digest,)),
    "Locate": _id_or_digest("read"),
    "Announce": _on_id("pull"),
    "Generate": _generate,
    "ListAdapters": lambda request: Need("read"),
    "StoreStatus": lambda request: Need("read"),
    "WhoAmI": lambda request: Need(None),
}

#: the calls that change state, each audited with its outcome (method -> action; Keep and Pin say which way)
CHANGES: dict[str, Callable[[Any], str]] = {
    "Stage": lambda request: "stage",
    "Unstage": lambda request: "unstage",
    "Keep": lambda request: "unkeep" if request.unkeep else "keep",
    "Pin": lambda request: "pin" if request.pinned else "unpin",
    "SetActive": lambda request: "set-active",
    "Promote": lambda request: "promote",
}
