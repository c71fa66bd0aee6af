"""The access gate: who each call is (a token's principal, or an mTLS identity), and whether it may do what it asks.

Installed in place of the single-token check when the node runs with
``--policy`` (``adapter_fabric.access``). For every fabric.v1 call it resolves the
principal, looks up the call's need in ``adapter_fabric.node.access_rules`` and checks the
verb on each id before the servicer (or the store) sees the request: a
refusal is PERMISSION_DENIED naming the verb and the prefix, the same for an
id that exists and one that does not. The principal then rides with the call
(``adapter_fabric.access.caller``) so listings show only what it may read. Changes and
refusals are audited (``adapter_fabric.observability.audit``); tokens never are.

Who a caller is: a bearer token that is the cluster's (``--auth-token-file``)
is the all-powerful cluster principal; another token must hash to a
principal's ``token_sha256``; without a token, a client certificate's SAN
names the principal. A call that is none of these is UNAUTHENTICATED, peer
reads included. Health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc

from adapter_fabric.access.caller import set_caller
from adapter_fabric.access.policy import CLUSTER, Principal, canonical_id, on_behalf, token_sha256
from adapter_fabric.access.policy_file import PolicyFile
from adapter_fabric.errors import Busy, FabricError, PermissionDenied, Unauthenticated
from adapter_fabric.node.access_rules import CHANGES, RULES, Need
from adapter_fabric.observability.audit import audit
from adapter_fabric.observability.metrics import ACCESS_REFUSALS
from adapter_fabric.rpc.security import AUTH_METADATA_KEY, ON_BEHALF_OF_KEY, OPEN_SERVICES
from adapter_fabric.rpc.status import FABRIC_PREFIX, abort_with
from adapter_fabric.store import AdapterStore
from adapter_fabric.v1 import fabric_pb2

_BEARER = "Bearer "
#: the auth-context key of a client certificate's subject alternative names
SAN_KEY = "x509_subject_alternative_name"


def _header(metadata: Sequence[tuple[str, Any]] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    text = _header(metadata, AUTH_METADATA_KEY)
    if text is None:
        return None
    return text[len(_BEARER):] if text.startswith(_BEARER) else ""


def _sans(context: grpc.aio.ServicerContext) -> list[str]:
    try:
        values = context.auth_context().get(SAN_KEY, [])
    except Exception:  # noqa: BLE001 (an insecure channel has no auth context on some gRPC versions)
        return []
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values]


class AccessGate(grpc.aio.ServerInterceptor):
    """Resolves each call's principal and checks its verb on its ids (``adapter_fabric.node.access_rules``) before the servicer runs."""

    def __init__(self, policy: PolicyFile, store: AdapterStore, cluster_token: str | None = None) -> None:
        self.policy = policy
        self.store = store
        self._cluster = (_BEARER + cluster_token).encode() if cluster_token else None
        self._cluster_hash = token_sha256(cluster_token) if cluster_token else ""

    # ------------------------------------------------------------ who

    def principal(self, token: str | None, sans: Sequence[str]) -> Principal:
        """The caller's principal; ``Unauthenticated`` when neither its token nor its certificate names one."""
        if token:
            if self._cluster is not None and hmac.compare_digest((_BEARER + token).encode("utf-8", "replace"), self._cluster):
                return CLUSTER
            found = self.policy.policy.by_token(token)
            if found is None:
                raise Unauthenticated("the call's bearer token is not the cluster's nor any principal's in this node's policy")
            return found
        found = self.policy.policy.by_san(list(sans)) if sans else None
        if found is None:
            raise Unauthenticated("this node's policy knows no principal for the call: send a bearer token, or a client certificate it names")
        return found

    def acting(self, sender: Principal, behalf: str | None) -> Principal:
        """The principal a call runs as: ``sender``, or, when a member names the caller it calls for
        (``fabric-on-behalf-of``), what both may do. A caller this node's policy does not know is ``PermissionDenied``."""
        if not behalf:
            return sender
        kind, _, value = behalf.partition(":")
        caller: Principal | None
        if kind == "sha256" and self._cluster_hash and hmac.compare_digest(value.encode("utf-8", "replace"), self._cluster_hash.encode()):
            caller = CLUSTER
        else:
            caller = self.policy.policy.by_identity(behalf)
        if caller is None:
            raise PermissionDenied(f"principal {sender.name!r} calls for a principal this node's policy does not know ({kind[:16]!r} identity)")
        return on_behalf(sender, caller)

    # ------------------------------------------------------------ may it

    async def admit(self, principal: Principal, method: str, need: Need) -> None:
        """Raise ``PermissionDenied`` (or ``InvalidAdapterId``) unless ``principal`` may do what ``need`` says; reads no id's state first."""
        verb = need.verb
        if verb is None or principal.may_everywhere(verb):
            return
        if need.everywhere:
            raise PermissionDenied(f"principal {principal.name!r} lacks {verb!r} on '*' ({method} without a named adapter)")
        for adapter_id in need.ids:
            canonical_id(adapter_id)  # a malformed id is refused as such (INVALID_ARGUMENT), whoever asks
            principal.check(verb, adapter_id)
        for digest in need.digests:
            ids = await asyncio.to_thread(self._ids_of, digest)
            if not any(principal.allows(verb, i) for i in ids):
                # the same words whether the digest is here under a foreign id or not here at all
                raise PermissionDenied(f"principal {principal.name!r} lacks {verb!r} on the ids of digest {digest[:64]!r}")
        if not need.ids and not need.digests and not principal.may_anywhere(verb):
            raise PermissionDenied(f"principal {principal.name!r} lacks {verb!r} on every prefix")

    def _ids_of(self, digest: str) -> list[str]:
        """The ids referring to ``digest``: committed, or the one a download of it (here, or left to resume) is for."""
        return self.store.ids_of(digest)

    async def admit_data(self, hello: fabric_pb2.DataHello, sans: Sequence[str]) -> StillAdmitted:
        """The data channel's hello: the same principal and the same pull check as a gRPC Fetch; what the stream asks again
        before each chunk (``StillAdmitted``)."""
        principal = self._who("Fetch", hello.token or None, sans, hello.on_behalf_of or None)
        await self._check(principal, "Fetch", hello.fetch)
        return StillAdmitted(self, "Fetch", hello.token or None, sans, hello.on_behalf_of or None, hello.fetch)

    def _who(self, method: str, token: str | None, sans: Sequence[str], behalf: str | None = None) -> Principal:
        try:
            return self.acting(self.principal(token, sans), behalf)
        except Unauthenticated as exc:
            audit(method, "-", "unauthenticated", detail=str(exc))
            raise
        except PermissionDenied as exc:
            ACCESS_REFUSALS.labels("on-behalf").inc()
            audit(method, "-", "refused", detail=str(exc))
            raise

    async def _check(self, principal: Principal, method: str, request: Any) -> None:
        rule = RULES.get(method)
        need = rule(request) if rule is not None else Need("admin", everywhere=True)
        try:
            await self.admit(principal, method, need)
        except PermissionDenied as exc:
            ACCESS_REFUSALS.labels(need.verb or "none").inc()
            audit(method, principal.name, "refused", adapter_id=need.ids[0] if need.ids else "", digest=need.digests[0] if need.digests else "",
                  detail=str(exc))
            raise
        set_caller(principal)

    # ------------------------------------------------------------ the interceptor

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES) or not details.method.startswith(FABRIC_PREFIX):
            return handler
        metadata = details.invocation_metadata
        return self._wrap(handler, details.method[len(FABRIC_PREFIX):], _bearer(metadata), _header(metadata, ON_BEHALF_OF_KEY))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, token: str | None, behalf: str | None = None) -> grpc.RpcMethodHandler:
        gate = self
        serializers = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

        async def admitted(request: Any, context: grpc.aio.ServicerContext, principal: Principal | None = None) -> Principal:
            try:
                who = principal or gate._who(method, token, _sans(context), behalf)
                await gate._check(who, method, request)
            except FabricError as exc:
                await abort_with(context, exc)  # raises: the call ends here
                raise
            return who

        if handler.request_streaming and handler.response_streaming:  # StageMany: admitted for publish somewhere; each id checked as it comes
            inner_bidi = handler.stream_stream

            async def stream_stream(request_iterator, context):
                await admitted(None, context)  # node.stage_many checks publish on each adapter's id (and audits)
                still = StillAdmitted(gate, method, token, _sans(context), behalf, None)

                async def watched():
                    async for message in request_iterator:
                        admitted_under = still.generation
                        await still.check()  # a revoked caller's stream ends refused
                        if still.generation != admitted_under:
                            # The stream's adapters are checked under the principal it opened with: past a reload, a
                            # new stream (the client opens one for the adapters not answered) is checked under the new one.
                            raise Busy(f"the access policy changed while this {method} stream was open; send the rest on a new stream")
                        yield message

                async with aclosing(inner_bidi(watched(), context)) as results:
                    async for result in results:
                        yield result

            return grpc.stream_stream_rpc_method_handler(stream_stream, **serializers)
        if handler.request_streaming:  # Stage: the first message names the id
            inner_stream = handler.stream_unary

            async def stream_unary(request_iterator, context):
                try:
                    principal = gate._who(method, token, _sans(context), behalf)  # before a byte of the stream is read
                except FabricError as exc:
                    await abort_with(context, exc)
                messages = request_iterator.__aiter__()
                first = await anext(messages, None)
                await admitted(first if first is not None else fabric_pb2.StageRequest(), context, principal)

                async def replay():
                    if first is not None:
                        yield first
                    async for message in messages:
                        yield message

                return await gate._audited(principal, method, first, inner_stream(replay(), context))

            return grpc.stream_unary_rpc_method_handler(stream_unary, **serializers)
        if handler.response_streaming:  # Fetch
            inner_gen = handler.unary_stream

            async def unary_stream(request, context):
                await admitted(request, context)
                still = StillAdmitted(gate, method, token, _sans(context), behalf, request)
                async with aclosing(inner_gen(request, context)) as items:
                    async for item in items:
                        try:
                            await still.check()  # a policy reload since: the next chunk goes only if it still allows the stream
                        except FabricError as exc:
                            await abort_with(context, exc)
                        yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, **serializers)
        inner = handler.unary_unary

        async def unary_unary(request, context):
            principal = await admitted(request, context)
            return await gate._audited(principal, method, request, inner(request, context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, **serializers)

    async def _audited(self, principal: Principal | None, method: str, request: Any, call: Awaitable[Any]) -> Any:
        """Run the admitted call; a change gets one audit line with its outcome."""
        action = CHANGES.get(method)
        if action is None or principal is None or request is None:
            return await call
        need = RULES[method](request)
        adapter_id = need.ids[0] if need.ids else ""
        digest = await asyncio.to_thread(self._digest_of, adapter_id) if method == "Unstage" else ""
        outcome = "failed"
        try:
            reply = await call
            outcome = "ok"
            return reply
        finally:
            if outcome == "ok":
                digest = getattr(reply, "digest", "") or digest
            audit(action(request), principal.name, outcome, adapter_id=adapter_id, digest=digest)

    def _digest_of(self, adapter_id: str) -> str:
        try:
            return self.store.get(adapter_id).digest
        except (FabricError, OSError):
            return ""


class StillAdmitted:
    """A running Fetch stream's admission, made again before each chunk once the policy changed (a SIGHUP, an edited file):
    a revoked principal's stream ends at its next chunk, ``PERMISSION_DENIED`` (``UNAUTHENTICATED`` once its token is gone)."""

    def __init__(self, gate: AccessGate, method: str, token: str | None, sans: Sequence[str], behalf: str | None, request: Any) -> None:
        self._gate = gate
        self._call = (method, token, tuple(sans), behalf, request)
        #: the policy generation the call was last admitted under
        self.generation = gate.policy.generation

    async def check(self) -> None:
        """Nothing while the policy admitted under is in force (one comparison); else the call's admission again."""
        if self._gate.policy.generation == self.generation:
            return
        self.generation = self._gate.policy.generation
        method, token, sans, behalf, request = self._call
        await self._gate._check(self._gate._who(method, token, sans, behalf), method, request)
