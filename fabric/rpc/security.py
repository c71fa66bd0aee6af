"""Who may talk to a node: TLS credentials from files, and a bearer token.

- ``TlsFiles``: PEM files named by flags. A server with a CA requires client
  certificates (mutual TLS); a node uses its own certificate as the client
  certificate when it pulls from peers.
- ``BearerAuth``: a grpc.aio server interceptor that checks
  ``authorization: Bearer <token>`` with a constant-time compare. Health and
  reflection stay open (load balancers and grpcurl need them); the peer reads
  (``Fetch``, ``GetManifest``, ``Availability``, ``Locate``) are open unless
  ``peer_reads`` is set; every other method needs the token.
- ``token_interceptor`` / ``channel``: the client side, for NodeClient, the
  CLI and node-to-node pulls. The token rides as plain metadata, so it works
  with or without TLS (use TLS wherever the network is not trusted).
"""

from __future__ import annotations

import collections
import hmac
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from adapter_fabric.errors import InvalidArgument, PermissionDenied, Unauthenticated
from adapter_fabric.rpc.status import refusing_handler

AUTH_METADATA_KEY = "authorization"
#: request metadata naming the caller a member node calls for: ``sha256:<hex of its token>`` or ``san:<identity>``
#: (``adapter_fabric.access.policy.identity_of``; the holder admits what both may do: ``adapter_fabric.node.gate``)
ON_BEHALF_OF_KEY = "fabric-on-behalf-of"
_BEARER = "Bearer "

#: methods any caller may use, auth or not
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: what a peer needs to pull from this node; open unless --auth-peer-reads
PEER_READ_METHODS = frozenset(f"/fabric.v1.Fabric/{m}" for m in ("Fetch", "GetManifest", "Availability", "Locate"))


# ---------------------------------------------------------------- TLS


def _read_pem(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} {path}: {exc.strerror}; check the --tls-* flags") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"the {what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this side's certificate chain and key, and the CA that signs the other side's."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together: give both, or neither")

    @property
    def enabled(self) -> bool:
        """Whether any TLS file is set."""
        return any(p is not None for p in (self.cert, self.key, self.ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS for a listening node; with a CA, clients must present a certificate it signed (mTLS)."""
        if self.cert is None or self.key is None:
            raise InvalidArgument("a node serving TLS needs --tls-cert and --tls-key (--tls-ca alone only verifies others)")
        pair = (_read_pem(self.key, "TLS key"), _read_pem(self.cert, "TLS certificate"))
        ca = _read_pem(self.ca, "TLS CA")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same TLS as ``server_credentials``, for the data channel (``adapter_fabric.node.data_server``): mTLS when a CA is given."""
        if self.cert is None or self.key is None:
            raise InvalidArgument("a node serving TLS needs --tls-cert and --tls-key (--tls-ca alone only verifies others)")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(cafile=str(self.ca))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self, *, anonymous: bool = False) -> ssl.SSLContext:
        """The same TLS as ``channel_credentials``, for a peer's data channel: the server verified, this side's certificate presented
        (``anonymous``: none)."""
        context = ssl.create_default_context(cafile=str(self.ca) if self.ca is not None else None)
        if self.cert is not None and self.key is not None and not anonymous:
            context.load_cert_chain(self.cert, self.key)
        return context

    def channel_credentials(self, *, anonymous: bool = False) -> grpc.ChannelCredentials:
        """TLS for a caller: verify the server against the CA (system roots when none); present cert/key when given.

        ``anonymous``: present no client certificate (a node dialling an address that is not a member of its cluster).
        """
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, "TLS CA"),
            private_key=None if anonymous else _read_pem(self.key, "TLS key"),
            certificate_chain=None if anonymous else _read_pem(self.cert, "TLS certificate"),
        )


# ---------------------------------------------------------------- the token


def read_token(path: Path | str) -> str:
    """The bearer token in ``path`` (surrounding whitespace ignored)."""
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"the token file {path} holds non-ASCII bytes: a bearer token is printable ASCII") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read the token file {path}: {exc.strerror}") from None
    return check_token(token, str(path))


def check_token(token: str, where: str = "the token") -> str:
    if not token:
        raise InvalidArgument(f"{where} is empty: put a random secret in it, e.g. `openssl rand -hex 32`")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise InvalidArgument(f"{where} must be printable ASCII without spaces (gRPC metadata carries it as-is)")
    return token


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, _BEARER + token),)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (the bearer token) to every call on a sync channel, in place of any the call carried under those keys."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._keys = {key for key, _ in metadata}

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] not in self._keys]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, *self._metadata],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


def token_interceptor(token: str) -> _MetadataInterceptor:
    return _MetadataInterceptor(bearer_metadata(check_token(token)))


def metadata_interceptor(metadata: tuple[tuple[str, str], ...]) -> _MetadataInterceptor:
    """An interceptor adding ``metadata`` to every call of a channel it wraps (``grpc.intercept_channel``)."""
    return _MetadataInterceptor(metadata)


def channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A sync channel to ``address``: TLS when ``credentials`` are given, the token on every call when given."""
    options = list(options)
    plain = grpc.secure_channel(address, credentials, options=options) if credentials is not None else grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(plain, token_interceptor(token)) if token else plain


# ---------------------------------------------------------------- the server side


#: a token-guarded call a member makes for one of its callers reaches a node with no policy: it cannot tell what that caller may do
BEHALF_WITHOUT_POLICY = (
    "the call is made for another principal (fabric-on-behalf-of), and this node has no --policy to check what that principal may do: "
    "run the nodes of a cluster with one policy"
)


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED, before the servicer runs.

    A call that carries the token and names a caller it is made for (``ON_BEHALF_OF_KEY``) is refused too
    (PERMISSION_DENIED): the token grants every verb here, which that caller may not hold; a call open without the token
    (a peer read without ``peer_reads``) is served as to anyone.
    """

    def __init__(self, token: str, *, peer_reads: bool = False) -> None:
        self._expected = (_BEARER + check_token(token)).encode()
        self.peer_reads = peer_reads

    def requires_token(self, method: str) -> bool:
        if method.startswith(OPEN_SERVICES):
            return False
        if method in PEER_READ_METHODS:
            return self.peer_reads
        return True  # everything else, including methods added later: closed by default

    def token_matches(self, token: str) -> bool:
        """Whether a bare ``token`` (the data channel's hello carries one) is this cluster's, compared in constant time."""
        return hmac.compare_digest((_BEARER + token).encode("utf-8", "replace"), self._expected)

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        ok = False
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                ok |= hmac.compare_digest(given, self._expected)  # constant time: no early exit on the first differing byte
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.requires_token(details.method):
            return handler
        if self.authorized(details.invocation_metadata):
            if any(key == ON_BEHALF_OF_KEY for key, _ in details.invocation_metadata or ()):
                return refusing_handler(handler, PermissionDenied(BEHALF_WITHOUT_POLICY))
            return handler
        has_header = any(key == AUTH_METADATA_KEY for key, _ in details.invocation_metadata or ())
        problem = "a wrong bearer token" if has_header else "no bearer token"
        return refusing_handler(handler, Unauthenticated(f"{details.method} needs this cluster's bearer token; the call carried {problem}"))
