"""One bound on every string, bytes and repeated field a node is sent, checked before anything else.

The table is derived by walking the request messages of every ``fabric.v1``
RPC (and the data channel's ``DataHello``) in the proto descriptors, so a
field added to the .proto is bounded without a line here: it gets its kind's
default. ``OVERRIDES`` raises or lowers the fields whose meaning asks for it.

``check`` runs at the service edge (``adapter_fabric.rpc.status.rpc_errors`` and the
data channel's hello), before a request is logged, echoed, forwarded or kept.
A refusal names the field and its limit and never echoes the value.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from adapter_fabric.errors import FieldTooLarge
from adapter_fabric.v1 import fabric_pb2

#: default longest string (characters) and bytes value: ids, names and digests are far shorter
DEFAULT_LENGTH = 1024
#: default most entries of a repeated or map field
DEFAULT_ITEMS = 1024
#: a gRPC message is at most this large anyway (adapter_fabric.transport.wire.MAX_MESSAGE_BYTES)
MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class Bound:
    """The limits of one field: ``length`` per value (strings and bytes), ``items`` per repeated field."""

    length: int | None
    items: int | None


#: fields whose meaning asks for another limit than their kind's default, by full name
OVERRIDES: dict[str, Bound] = {
    "fabric.v1.StageBegin.config_json": Bound(1 << 20, None),  # adapter_config.json: a few KiB in practice
    "fabric.v1.StageData.data": Bound(MESSAGE_BYTES, None),  # the upload's bytes: the store's size limits apply
    "fabric.v1.StageManyRequest.data": Bound(MESSAGE_BYTES, None),  # one adapter's weights (node.stage_many refuses past one piece, by name)
    "fabric.v1.FetchRequest.accept_bitmap": Bound(1 << 20, None),  # one bit per chunk: 8M chunks
    "fabric.v1.DataHello.holder_bitmap": Bound(1 << 20, None),
    "fabric.v1.DataHello.token": Bound(4096, None),
    "fabric.v1.PromoteRequest.peer": Bound(512, None),  # host:port; a DNS name is at most 253 characters
    "fabric.v1.PeftFields.target_modules_pattern": Bound(4096, None),  # a regex
    "fabric.v1.GenerateRequest.input_ids": Bound(None, 1 << 16),  # a prompt's token ids
}


def shown(value: str, limit: int = DEFAULT_LENGTH) -> str:
    """``value`` for a log line, or only its length when it is past ``limit`` (what an access log notes before ``check``)."""
    return value if len(value) <= limit else f"<{len(value)} characters, over the {limit}-character bound>"


def request_types() -> list[Descriptor]:
    """What a node is sent: every RPC's request message and the data channel's hello."""
    service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]
    return [method.input_type for method in service.methods] + [fabric_pb2.DataHello.DESCRIPTOR]


def _default(field: FieldDescriptor) -> Bound:
    sized = field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
    return Bound(DEFAULT_LENGTH if sized else None, DEFAULT_ITEMS if field.is_repeated else None)


def _walk(message: Descriptor, table: dict[str, Bound]) -> None:
    for field in message.fields:
        if field.full_name in table:
            continue
        table[field.full_name] = OVERRIDES.get(field.full_name, _default(field))
        if field.message_type is not None:
            _walk(field.message_type, table)  # nested messages and map entries (their key and value)


def build_table() -> dict[str, Bound]:
    """Every field reachable from a request type, with its bound."""
    table: dict[str, Bound] = {}
    for message in request_types():
        _walk(message, table)
    return table


BOUNDS: dict[str, Bound] = build_table()


def _refuse(field: FieldDescriptor, size: int, limit: int, what: str) -> FieldTooLarge:
    return FieldTooLarge(f"{field.containing_type.name}.{field.name} is {size} {what} long; this node takes at most {limit}")


def _check_value(field: FieldDescriptor, value: object, bound: Bound) -> None:
    if isinstance(value, Message):
        check(value)
    elif isinstance(value, (str, bytes)) and bound.length is not None and len(value) > bound.length:
        raise _refuse(field, len(value), bound.length, "characters" if isinstance(value, str) else "bytes")


def check(message: Message) -> None:
    """Raise ``FieldTooLarge`` naming the first field of ``message`` (nested included) past its bound."""
    message.DiscardUnknownFields()  # fields this version does not know are never kept, whatever their size
    for field, value in message.ListFields():
        bound = BOUNDS.get(field.full_name) or _default(field)
        if not field.is_repeated:
            _check_value(field, value, bound)
            continue
        if bound.items is not None and len(value) > bound.items:
            raise _refuse(field, len(value), bound.items, "entries")
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key, val = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for k, v in value.items():
                _check_value(key, k, BOUNDS.get(key.full_name) or _default(key))
                _check_value(val, v, BOUNDS.get(val.full_name) or _default(val))
        else:
            for item in value:
                _check_value(field, item, bound)


async def checked_stream(messages: AsyncIterator[Message]) -> AsyncIterator[Message]:
    """``messages``, each checked as it arrives (a client stream such as Stage)."""
    async for message in messages:
        check(message)
        yield message

