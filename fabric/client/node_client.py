"""A blocking client of one node, for the CLI, the demo, scripts, notebooks and services.

Every method returns a documented dataclass (``adapter_fabric.client.results``) and
raises the library's error types (``PoolFull``, ``AdapterNotFound``, ...,
mapped from the gRPC status once, in ``adapter_fabric.rpc.status``), so callers handle
errors the same way in-process or remote.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_fabric.client.adapter_dir import adapter_files
from adapter_fabric.client.addresses import WAIT_HINT, check_address, unreachable_hint
from adapter_fabric.client.results import ActiveSlot, Availability, GenerateResult, Identity, Listing, Location, PeerHolding, PromoteResult, StageResult, StoreStatus
from adapter_fabric.errors import BadSignature, ClientClosed, DeadlineExceeded, InvalidArgument, PeerUnavailable
from adapter_fabric.format.config import CONFIG_FILE
from adapter_fabric.rpc import security
from adapter_fabric.rpc.security import TlsFiles
from adapter_fabric.rpc.status import ERROR_DETAIL_KEY, error_from_rpc
from adapter_fabric.store.digests import DIGEST_SCHEME, WEIGHTS_FILE, adapter_digest, check_scheme, hash_bytes, hash_file, whole_file_blake3
from adapter_fabric.store.manifest import Manifest, manifest_request
from adapter_fabric.transport import wire
from adapter_fabric.trust.signing import Signed
from adapter_fabric.units import format_size
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

UPLOAD_PIECE = 1 << 20
#: default deadline of calls that move an adapter (stage, promote, pull): generous, pulls of GBs take minutes
LONG_CALL_TIMEOUT_S = 3600.0
#: what ``generate`` asks for when the caller does not say (``fabric generate`` too)
DEFAULT_MAX_NEW_TOKENS = 8

# Unary calls retry on UNAVAILABLE by gRPC's own retry policy (a node restarting, a
# connection reset); streams resume by offset instead, which only the caller can do.
_RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "fabric.v1.Fabric", "method": m} for m in ("GetManifest", "ListAdapters", "UploadOffset", "Availability")],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)



def _deadline(timeout: float | None, default: float | None) -> float | None:
    """gRPC's deadline for a call: ``default`` for None (and ``False``, which meant the default before), none for 0."""
    if timeout is None or timeout is False:
        return default or None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:  # nan fails too
        raise InvalidArgument(f"timeout={timeout!r}: give seconds (0 for no deadline), or None for the client's own")
    return float(timeout) or None


def _signed(sign_key: bytes | None, digest: str) -> Signed:
    from adapter_fabric.trust.signing import sign

    assert sign_key is not None
    return sign(sign_key, digest)


class NodeClient:
    """A blocking client of one node: stage, promote, pull, list, pin, generate, health, and the peer reads.

    Use it as a context manager, or call ``close`` to drop the channel.
    Deadlines: ``timeout`` (seconds) bounds each quick call, ``long_timeout`` the calls that move an
    adapter (``stage``, ``stage_many``, ``promote``, ``pull``; None or 0: no deadline). Every call also
    takes ``timeout=``: seconds for that call alone; None (the default) means the client's own (``timeout``
    or ``long_timeout``), 0 no deadline. Past a deadline a call raises ``DeadlineExceeded`` (a kind of
    ``PeerUnavailable``); a call on a closed client raises ``ClientClosed``.
    """

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        tls: TlsFiles | None = None,
        token: str | None = None,
        timeout: float = 120.0,
        long_timeout: float | None = LONG_CALL_TIMEOUT_S,
    ) -> None:
        """``address``: host:port; ``tls``: CA (and, for mTLS, this client's cert and key) as files; ``token``: the cluster's bearer token."""
        self.address = check_address(address)
        options = [*wire.CHANNEL_OPTIONS, ("grpc.service_config", _RETRY_SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        self._tls = credentials is not None or (tls is not None and tls.enabled)
        self._client_cert = tls is not None and tls.cert is not None
        if credentials is None and tls is not None and tls.enabled:
            credentials = tls.channel_credentials()
        self.channel = security.channel(address, credentials=credentials, token=token, options=options)
        self.stub = fabric_pb2_grpc.FabricStub(self.channel)
        self.timeout = timeout
        self.long_timeout = long_timeout
        self._closed = False

    def close(self) -> None:
        """Close the channel (in-flight calls are cancelled); a later call raises ``ClientClosed``."""
        self._closed = True
        self.channel.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        """``ClientClosed`` after ``close``: grpc raises a bare ValueError for a call on a closed channel (and a stub made on
        one crashes the process)."""
        if self._closed:
            raise ClientClosed(f"this NodeClient of {self.address} is closed (close() was called, or its with block ended): make a new NodeClient")

    def _call(self, method, request, **kwargs):
        self._check_open()
        try:
            return method(request, timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except grpc.RpcError as exc:
            raise self.error_of(exc) from None

    def error_of(self, exc: grpc.RpcError):
        """The ``FabricError`` a failed call to this node means (the node's own error detail, or its transport's failure, named)."""
        has_detail = any(key == ERROR_DETAIL_KEY for key, _ in (exc.trailing_metadata() or ()))
        if not has_detail and exc.code() == grpc.StatusCode.UNAVAILABLE:
            # The transport to the node itself failed (nothing the node said): name it, and say what to change.
            hint = unreachable_hint(exc.details() or "", tls=self._tls, client_cert=self._client_cert)
            return PeerUnavailable(f"node {self.address} unreachable: UNAVAILABLE: {exc.details()}; {hint}")
        if not has_detail and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(
                f"node {self.address} did not answer in time (the node may go on with the work; call again, or allow more time: "
                "the call's timeout=, or --timeout)"
            )
        return error_from_rpc(exc, peer=self.address)

    def _quick(self, timeout: float | None) -> float | None:
        """A quick call's deadline in seconds (None: none): the caller's ``timeout``, else the client's."""
        return _deadline(timeout, self.timeout)

    def long_deadline(self, timeout: float | None) -> float | None:
        """The deadline of a call that moves an adapter: the caller's ``timeout``, else the client's ``long_timeout``."""
        return _deadline(timeout, self.long_timeout)

    # ------------------------------------------------------------ health

    def health(self, timeout: float = 5.0) -> str:
        """The node's gRPC health status: ``SERVING``, ``NOT_SERVING`` (shutting down) or ``UNKNOWN``."""
        self._check_open()
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self._call(stub.Check, health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_serving(self, timeout: float | None = 60.0, poll: float = 0.1) -> None:
        """Poll health until ``SERVING``; ``PeerUnavailable`` naming the last problem after ``timeout`` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                status = self.health(timeout=2.0)
                if status == "SERVING":
                    return
                last = f"health {status}"
            except PeerUnavailable as exc:
                last = str(exc)
            if deadline is not None and time.monotonic() > deadline:
                # the unreachable hint suggests `fabric wait`, which is what timed out: say what else to check
                last = last.replace(WAIT_HINT, "is fabric-node running and listening there? (its log says why it stopped, or raise --timeout)")
                raise PeerUnavailable(f"node {self.address} not SERVING after {timeout:g} s: {last}")
            time.sleep(poll)

    # ------------------------------------------------------------ staging

    def upload_offset(self, adapter_id: str, blake3: str) -> int:
        """How many bytes of an interrupted upload of these weights (their whole-file BLAKE3, ``b3sum``) the node holds (0: none)."""
        return self.upload_target(adapter_id, blake3).offset

    def upload_target(self, adapter_id: str, blake3: str) -> fabric_pb2.UploadOffsetResponse:
        """The node's kept offset and the chunk size it stages with; a node of another digest scheme is refused by name."""
        reply = self._call(self.stub.UploadOffset, fabric_pb2.UploadOffsetRequest(adapter_id=adapter_id, safetensors_blake3=blake3))
        check_scheme(reply.digest_scheme, f"node {self.address}")
        return reply

    def stage(
        self,
        adapter_dir: str | Path,
        adapter_id: str,
        progress: Callable[[int, int], None] | None = None,
        piece_size: int = UPLOAD_PIECE,
        *,
        timeout: float | None = None,
        on_resume: Callable[[int, int], None] | None = None,
        sign_key: bytes | None = None,
        signature: Signed | None = None,
        target: fabric_pb2.UploadOffsetResponse | None = None,
    ) -> StageResult:
        """Upload a PEFT directory; resumes where an interrupted upload of the same bytes stopped.

        ``progress(done, total)`` is called as bytes go out; ``on_resume(offset, total)``
        once, before any byte, when the node already held ``offset`` bytes.
        ``timeout``: seconds for the whole upload (None: the client's ``long_timeout``; 0: no deadline).
        ``sign_key``: an Ed25519 private key (PEM or 32 raw bytes); the adapter's digest is signed with it
        and the signature travels with its manifest (``adapter_fabric.trust.signing``). ``signature``: a signature made
        elsewhere (``fabric sign --out``, ``adapter_fabric.trust.signing.sign``), attached instead: it must be over the
        digest these files have at the node's chunk size (``BadSignature`` before any byte is sent otherwise).
        ``target``: where to start and the node's chunk size, when the caller knows them (``upload_target``; bulk staging's
        small adapters); None asks the node.
        """
        config_path, weights_path = adapter_files(adapter_dir)
        size = weights_path.stat().st_size
        blake3 = whole_file_blake3(weights_path)  # names the upload before the node's chunk size is known
        target = target if target is not None else self.upload_target(adapter_id, blake3)
        offset = target.offset
        if offset and on_resume:
            on_resume(offset, size)
        config = config_path.read_bytes()
        # The weights root at the node's chunk size: the node checks its bytes against it, and it names the digest a signer signs.
        weights_root = hash_file(WEIGHTS_FILE, weights_path, target.chunk_size).root
        begin = fabric_pb2.StageBegin(
            adapter_id=adapter_id, config_json=config, safetensors_size=size, safetensors_blake3=blake3, weights_root=weights_root,
            offset=offset, digest_scheme=DIGEST_SCHEME,
        )
        if sign_key is not None or signature is not None:
            digest = adapter_digest(hash_bytes(CONFIG_FILE, config, target.chunk_size).root, weights_root)
            signed = signature if signature is not None else _signed(sign_key, digest)
            if signature is not None and not signature.verifies(digest):
                raise BadSignature(
                    f"the signature given is not over this adapter's digest {digest[:16]}... at node {self.address}'s chunk size of "
                    f"{format_size(target.chunk_size)}: sign this directory again (fabric sign DIR --key KEY "
                    f"--chunk-size {format_size(target.chunk_size).replace(' ', '')} --out FILE)"
                )
            begin.signature, begin.signer_public_key = signed.signature, signed.public_key

        def requests() -> Iterator[fabric_pb2.StageRequest]:
            yield fabric_pb2.StageRequest(begin=begin)
            with open(weights_path, "rb") as f:
                f.seek(offset)
                position = offset
                if progress:
                    progress(position, size)
                while block := f.read(piece_size):
                    yield fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=position, data=block))
                    position += len(block)
                    if progress:
                        progress(position, size)

        r = self._call(self.stub.Stage, requests(), timeout=self.long_deadline(timeout))
        return StageResult(r.adapter_id, r.digest, r.content_id, r.bytes_received, r.already_staged, resumed_from=offset)

    def stage_many(self, items, workers: int = 16, *, timeout: float | None = None, on_done=None):
        """Stage many ``(directory, adapter_id)`` pairs (``adapter_fabric.client.bulk``): adapters of one upload piece on one
        StageMany stream (``adapter_fabric.client.stage_stream``; an older node: as the larger ones), the larger ones
        ``workers`` concurrent Stage calls at a time.

        Returns a ``BulkStageResult``: the committed ``StageResult`` s and each failed adapter named with its error;
        one adapter's failure leaves the others committed. ``timeout`` applies to each adapter's Stage, and to each stream.
        """
        from adapter_fabric.client.bulk import BatchStage, stage_many
        from adapter_fabric.client.stage_stream import StreamStage

        return stage_many(BatchStage(self, timeout, UPLOAD_PIECE), items, workers, on_done, streamed=StreamStage(self, timeout), piece_size=UPLOAD_PIECE)

    def unstage(self, adapter_id: str, *, timeout: float | None = None) -> bool:
        """Remove an id from the node's store; True when its bytes went too (no other id shares them). ``timeout`` as ``locate``."""
        return self._call(self.stub.Unstage, fabric_pb2.UnstageRequest(adapter_id=adapter_id), timeout=self._quick(timeout)).bytes_removed

    def keep(self, adapter_id: str, kept: bool = True, *, timeout: float | None = None) -> bool:
        """Keep a staged adapter on the node (its evicting store never drops it), or with ``kept=False`` stop keeping it. ``timeout`` as ``locate``."""
        return self._call(self.stub.Keep, fabric_pb2.KeepRequest(adapter_id=adapter_id, unkeep=not kept), timeout=self._quick(timeout)).kept

    def manifest(self, adapter_id: str, *, timeout: float | None = None) -> Manifest:
        """The manifest the node holds for an id (files, sizes, digests, chunking, config, tensor index), every claim checked. ``timeout`` as ``locate``."""
        return Manifest.from_proto(self.manifest_proto(adapter_id, timeout=timeout))

    def manifest_proto(self, adapter_id: str, *, with_sha256: bool = False, timeout: float | None = None) -> fabric_pb2.Manifest:
        """The manifest as the wire carries it (for tools that fetch chunks themselves).

        ``with_sha256``: the node also answers each file's sha256 (``file_sha256``), e.g. to compare with a hub's listing.
        """
        return self._call(self.stub.GetManifest, manifest_request(adapter_id, with_sha256=with_sha256), timeout=self._quick(timeout))

    # ------------------------------------------------------------ slots

    def promote(
        self,
        adapter_id: str,
        *,
        peer: str = "",
        name: str = "",
        peft: fabric_pb2.PeftFields | None = None,
        pin: bool = False,
        stage_only: bool = False,
        named_peer_only: bool = False,
        base_model: str = "",
        export_version: bool = False,
        timeout: float | None = None,
    ) -> PromoteResult:
        """Make the node pull ``adapter_id`` (from ``peer`` and the swarm) and load it as ``name``; the result names slot and evicted adapter.

        ``stage_only``: pull into the store, load no slot (see ``pull``); ``named_peer_only``: pull from
        ``peer`` alone, not the swarm; ``pin``: pin it too (refused before anything is evicted when
        the pin limit is reached). ``timeout``: seconds (None: the client's ``long_timeout``; 0: no deadline).
        A promote that loads a slot makes the adapter the node's active one (replacing a ``set_active`` choice).
        """
        request = fabric_pb2.PromoteRequest(
            peer=peer, adapter_id=adapter_id, name=name, pin=pin, stage_only=stage_only, named_peer_only=named_peer_only, base_model=base_model,
            export_version=export_version,
        )
        if peft is not None:
            request.peft.CopyFrom(peft)
        return PromoteResult.from_proto(self._call(self.stub.Promote, request, timeout=self.long_deadline(timeout)))

    def pull(
        self, adapter_id: str, *, peer: str = "", named_peer_only: bool = False, base_model: str = "", export_version: bool = False,
        timeout: float | None = None,
    ) -> PromoteResult:
        """Pull ``adapter_id`` into the node's store without loading a slot (``slot`` is -1): from ``peer`` (and the swarm), or,
        with no ``peer``, from wherever the node finds it (held, its known peers, its origins).

        ``base_model``: refuse an adapter for another base model; ``export_version``: also export it under a name of its digest.
        """
        return self.promote(
            adapter_id, peer=peer, stage_only=True, named_peer_only=named_peer_only, base_model=base_model, export_version=export_version, timeout=timeout
        )

    def locate(self, adapter_id: str = "", digest: str = "", *, timeout: float | None = None) -> Location:
        """Which of the node's known peers hold an adapter, fully or in part. ``timeout``: seconds (None: the client's ``timeout``; 0: none)."""
        r = self._call(self.stub.Locate, fabric_pb2.LocateRequest(adapter_id=adapter_id, digest=digest), timeout=self._quick(timeout))
        return Location(r.digest, [PeerHolding(p.address, p.complete, p.verified_chunks) for p in r.peers])

    def availability(self, digest: str, *, timeout: float | None = None) -> Availability:
        """Which chunks of ``digest`` the node holds verified (also while it is still receiving them). ``timeout`` as ``locate``."""
        r = self._call(self.stub.Availability, fabric_pb2.AvailabilityRequest(digest=digest), timeout=self._quick(timeout))
        return Availability(r.complete, r.chunk_count, bytes(r.verified_bitmap))

    def list(self, page_size: int = 0, *, timeout: float | None = None) -> Listing:
        """The node's staged adapters (every page, sorted by id) and its slots (name, content id, refs, pin, active). ``timeout`` (per page) as ``locate``."""
        pages = list(self.list_pages(page_size, timeout=timeout))
        return dataclasses.replace(pages[0], staged=[a for page in pages for a in page.staged])

    def list_pages(self, page_size: int = 0, *, timeout: float | None = None) -> Iterator[Listing]:
        """The listing one page at a time (``page_size`` adapters each; 0 = the node's default), slots on every page."""
        if not 0 <= page_size < 1 << 32:  # a uint32 on the wire
            raise InvalidArgument(f"page_size must be a whole number from 0 (the node's default) up, got {page_size!r}")
        token = ""
        while True:
            request = fabric_pb2.ListAdaptersRequest(page_size=page_size, page_token=token)
            reply = self._call(self.stub.ListAdapters, request, timeout=self._quick(timeout))
            yield Listing.from_proto(reply)
            token = reply.next_page_token
            if not token:
                return

    def whoami(self, *, timeout: float | None = None) -> Identity:
        """The principal this client's credentials are to the node, with its grants (verbs on id prefixes). ``timeout`` as ``locate``."""
        return Identity.from_proto(self._call(self.stub.WhoAmI, fabric_pb2.WhoAmIRequest(), timeout=self._quick(timeout)))

    def store_status(self, *, timeout: float | None = None) -> StoreStatus:
        """The node's store: bytes used and quota, the uploads and partial downloads it keeps (age, bytes), damaged entries. ``timeout`` as ``locate``."""
        return StoreStatus.from_proto(self._call(self.stub.StoreStatus, fabric_pb2.StoreStatusRequest(), timeout=self._quick(timeout)))

    def set_active(self, name: str, *, timeout: float | None = None) -> ActiveSlot:
        """Make a resident adapter the node's active one (what slot -1 means). ``timeout`` as ``locate``."""
        r = self._call(self.stub.SetActive, fabric_pb2.SetActiveRequest(name=name), timeout=self._quick(timeout))
        return ActiveSlot(r.slot, r.content_id)

    def pin(self, name: str, pinned: bool = True, *, timeout: float | None = None) -> int:
        """Pin (or unpin) a resident adapter against eviction; returns its slot. At most slots - 1 may be pinned. ``timeout`` as ``locate``."""
        return self._call(self.stub.Pin, fabric_pb2.PinRequest(name=name, pinned=pinned), timeout=self._quick(timeout)).slot

    def generate(
        self, input_ids: builtins.list[int], adapter: str = "", *, use_base: bool = False, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        return_logits: bool = False, timeout: float | None = None,
    ) -> GenerateResult:
        """Run the node's model on ``input_ids`` with a resident adapter (or the base model); greedy tokens and, if asked, the last logits.

        ``timeout``: seconds (None: the client's ``timeout``; 0: none); past it, ``DeadlineExceeded``.
        Ids or a count the wire cannot carry are ``InvalidArgument``, before anything is sent.
        """
        try:
            request = fabric_pb2.GenerateRequest(
                adapter=adapter, use_base=use_base, input_ids=input_ids, max_new_tokens=max_new_tokens, return_logits=return_logits
            )
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"generate: input_ids must be integers 0 to 2147483647 and max_new_tokens 0 to 4294967295 ({exc})") from None
        reply = self._call(self.stub.Generate, request, timeout=self._quick(timeout))
        return GenerateResult(list(reply.output_ids), list(reply.last_logits), reply.slot, reply.content_id)
