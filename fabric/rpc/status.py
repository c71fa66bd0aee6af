"""The one place where library errors become gRPC status codes, and back.

Servicer methods raise ``adapter_fabric.errors`` types; ``rpc_errors`` turns each into
its code, with the message and a serialized ``ErrorDetail`` in the trailing
metadata so a client in any language can act on the kind. Clients turn a
status back into the same library type with ``error_from_rpc``. Before a
method sees its request, ``rpc_errors`` holds it to ``adapter_fabric.rpc.bounds``.

Beside that trailer, the standard ``grpc-status-details-bin`` carries a
``google.rpc.Status`` whose ``ErrorInfo`` names the error type (``reason``,
in the ``fabric.v1`` domain), so grpcurl and other languages' gRPC libraries
show the kind without knowing fabric's own message.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from adapter_fabric import errors
from adapter_fabric.rpc import bounds
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger(__name__)

ERROR_DETAIL_KEY = "fabric-error-bin"
#: every method of the Fabric service starts with this (health and reflection do not)
FABRIC_PREFIX = "/fabric.v1.Fabric/"
#: the ErrorInfo domain of fabric's errors in grpc-status-details-bin
ERROR_DOMAIN = "fabric.v1"

# Most specific first: the first isinstance match wins.
_CODES: tuple[tuple[type[errors.FabricError], grpc.StatusCode], ...] = (
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Untrusted, grpc.StatusCode.PERMISSION_DENIED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.PoolFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.TooManySigners, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Busy, grpc.StatusCode.ABORTED),
    (errors.SlotBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.IncompatibleAdapter, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.IncompatibleFormat, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AdaptersUnsupported, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StoreMissing, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BadSignature, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.IntegrityError, grpc.StatusCode.DATA_LOSS),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),  # before PeerUnavailable: it is one
    (errors.PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ClientClosed, grpc.StatusCode.FAILED_PRECONDITION),  # raised by a client, never sent: mapped for completeness
)

_ADVICE: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: "retry later",
    grpc.StatusCode.UNAVAILABLE: "check the peer address and that the peer is running, then retry",
    grpc.StatusCode.DATA_LOSS: "the bytes were not used; retry, or re-stage the adapter on its source",
    grpc.StatusCode.UNAUTHENTICATED: "send the cluster's bearer token: --auth-token-file, or FABRIC_AUTH_TOKEN_FILE",
}


#: longest error message sent (and logged): gRPC's metadata limit is 16 KiB, and an echoed name may be far longer
MAX_MESSAGE_CHARS = 1024


def bounded(message: str) -> str:
    """``message`` cut to ``MAX_MESSAGE_CHARS``, saying how much was cut."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters cut)"


def status_code_for(exc: errors.FabricError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_detail(exc: errors.FabricError, message: str) -> bytes:
    """The ``fabric-error-bin`` trailer: the error's type, message and retryability, for clients to rebuild it."""
    bound = exc.bound if isinstance(exc, errors.QuotaExceeded) else ""
    return fabric_pb2.ErrorDetail(kind=type(exc).__name__, message=message, retryable=exc.retryable, bound=bound).SerializeToString()


def rich_status(exc: errors.FabricError, code: grpc.StatusCode, message: str) -> grpc.Status:
    """The standard status details: a google.rpc.Status with an ErrorInfo naming the error type."""
    info = error_details_pb2.ErrorInfo(reason=type(exc).__name__, domain=ERROR_DOMAIN, metadata={"retryable": str(exc.retryable).lower()})
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail]))


#: advice for one error type, before its code's (RESOURCE_EXHAUSTED is both a busy pool and a full store)
_ADVICE_BY_TYPE: dict[type[errors.FabricError], str] = {
    errors.PoolFull: "retry once a running sequence ends",
    errors.QuotaExceeded: "retry once there is room under the limit",
}


def public_message(exc: errors.FabricError) -> str:
    """The message a caller is sent: bounded, with the advice its type or status code carries."""
    code = status_code_for(exc)
    message = bounded(str(exc))
    # a non-retryable RESOURCE_EXHAUSTED (a pin past the pin limit) gets no "retry" advice: only an unpin frees it
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not exc.retryable:
        return message
    advice = next((text for kind, text in _ADVICE_BY_TYPE.items() if isinstance(exc, kind)), _ADVICE.get(code))
    return f"{message} ({advice})" if advice else message


def error_from_detail(detail_bytes: bytes) -> errors.FabricError | None:
    """The library error a serialized ``ErrorDetail`` names, with the bound it names when it is one of ``NAMED_BOUNDS``;
    None when it names no fabric error type (or does not parse)."""
    try:
        detail = fabric_pb2.ErrorDetail.FromString(detail_bytes)
    except Exception:  # noqa: BLE001 (protobuf's DecodeError and friends: a malformed trailer is no error type)
        return None
    kind = getattr(errors, detail.kind, None)
    if not (isinstance(kind, type) and issubclass(kind, errors.FabricError)):
        return None
    error = kind(bounded(detail.message))
    if isinstance(error, errors.QuotaExceeded):
        error.bound = detail.bound if detail.bound in errors.NAMED_BOUNDS else ""
    return error


async def abort_with(context: grpc.aio.ServicerContext, exc: errors.FabricError) -> None:
    code = status_code_for(exc)
    message = public_message(exc)
    # The detail carries the advice too: Python clients rebuild the error from it.
    trailer = ((ERROR_DETAIL_KEY, error_detail(exc, message)), *rich_status(exc, code, message).trailing_metadata)
    context.set_trailing_metadata(trailer)
    await context.abort(code, message, trailer)


def refusing_handler(handler: grpc.RpcMethodHandler, error: errors.FabricError) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses with ``error`` without calling it (nothing is read or done)."""

    async def refuse(request_or_iterator, context) -> None:
        await abort_with(context, error)

    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def within_bounds(request: Any) -> Any:
    """``request`` checked against ``adapter_fabric.rpc.bounds`` (a client stream: each message as it arrives), before any use of it."""
    if isinstance(request, Message):
        bounds.check(request)
        return request
    return bounds.checked_stream(request)


def rpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a grpc.aio servicer method (coroutine or async generator) to bound its request and map FabricError."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, within_bounds(request), context):
                    yield item
            except errors.FabricError as exc:
                # Logged here: the node's RpcObserver (which logs every other call once) passes response streams by.
                log.info("%s refused: %s: %s", method.__name__, type(exc).__name__, bounded(str(exc)))
                await abort_with(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, within_bounds(request), context)
        except errors.FabricError as exc:
            # Not logged here: the node's RpcObserver logs each call once, the refusal's type and message included.
            await abort_with(context, exc)

    return unary_wrapper


def error_from_rpc(exc: grpc.RpcError, *, peer: str = "") -> errors.FabricError:
    """The library error a failed call stands for (clients re-raise it)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_DETAIL_KEY:
            error = error_from_detail(value)
            if error is not None:
                return error
    where = f" from {peer}" if peer else ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(f"peer{where} did not answer in time: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return errors.PeerUnavailable(f"peer{where} unavailable: {code.name}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.AdapterNotFound(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.Unauthenticated(f"call{where} refused: {details}")
    return errors.FabricError(f"call{where} failed: {code.name}: {details}")
