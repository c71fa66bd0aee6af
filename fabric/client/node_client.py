"""A blocking client of one node, for the CLI, the demo, scripts and tests.

Failed calls raise the library error they stand for (``fabric.rpc.status.error_from_rpc``),
so callers handle ``PoolFull`` or ``AdapterNotFound`` the same way in-process or remote.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc

from fabric.rpc import security

from fabric.transport import wire
from fabric.format.config import CONFIG_FILE
from fabric.errors import InvalidAdapter
from fabric.rpc.security import TlsFiles
from fabric.rpc.status import error_from_rpc
from fabric.v1 import fabric_pb2, fabric_pb2_grpc

WEIGHTS_FILE = "adapter_model.safetensors"
UPLOAD_PIECE = 1 << 20

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


def sha256_file(path: Path, piece: int = 4 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(piece):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    last_logits: list[float]
    slot: int
    content_id: int


class NodeClient:
    """A blocking client of one node: stage, promote, list, generate, and the peer reads.

    Errors come back as the library's own types (``PoolFull``, ``AdapterNotFound``, ...,
    mapped from the gRPC status once, in ``fabric.rpc.status``). Use it as a context
    manager, or call ``close`` to drop the channel.
    """

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        tls: TlsFiles | None = None,
        token: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        """``tls``: CA (and, for mTLS, this client's cert and key) as files; ``token``: the cluster's bearer token."""
        options = [*wire.CHANNEL_OPTIONS, ("grpc.service_config", _RETRY_SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        self.address = address
        if credentials is None and tls is not None and tls.enabled:
            credentials = tls.channel_credentials()
        self.channel = security.channel(address, credentials=credentials, token=token, options=options)
        self.stub = fabric_pb2_grpc.FabricStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        self.channel.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, **kwargs):
        try:
            return method(request, timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, peer=self.address) from None

    # ------------------------------------------------------------ staging

    def stage(
        self, adapter_dir: str | Path, adapter_id: str, progress: Callable[[int, int], None] | None = None, piece_size: int = UPLOAD_PIECE,
        sign_key: bytes | None = None,
    ) -> fabric_pb2.StageResponse:
        """Upload a PEFT directory; resumes where an interrupted upload of the same bytes stopped.

        ``sign_key``: an Ed25519 private key (PEM or 32 raw bytes); the adapter's digest is signed with it
        and the signature travels with its manifest (``fabric.trust.signing``)."""
        adapter_dir = Path(adapter_dir)
        config_path, weights_path = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise InvalidAdapter(f"{path} does not exist: a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
        size = weights_path.stat().st_size
        digest = sha256_file(weights_path)
        offset = self._call(self.stub.UploadOffset, fabric_pb2.UploadOffsetRequest(adapter_id=adapter_id, safetensors_sha256=digest)).offset
        config = config_path.read_bytes()
        begin = fabric_pb2.StageBegin(adapter_id=adapter_id, config_json=config, safetensors_size=size, safetensors_sha256=digest, offset=offset)
        if sign_key is not None:
            from fabric.store.digests import adapter_digest, hash_bytes
            from fabric.trust.signing import sign_digest

            begin.signature = sign_digest(sign_key, adapter_digest(hash_bytes(CONFIG_FILE, config, UPLOAD_PIECE).sha256, digest))

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

        return self._call(self.stub.Stage, requests())

    def unstage(self, adapter_id: str) -> bool:
        """Remove an id from the node's store; True when its bytes went too (no other id shares them)."""
        return self._call(self.stub.Unstage, fabric_pb2.UnstageRequest(adapter_id=adapter_id)).bytes_removed

    def manifest(self, adapter_id: str) -> fabric_pb2.Manifest:
        """The manifest the node holds for an id: files, sizes, digests, chunking, config and tensor index."""
        return self._call(self.stub.GetManifest, fabric_pb2.GetManifestRequest(adapter_id=adapter_id))

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
    ) -> fabric_pb2.PromoteResponse:
        """Make the node pull ``adapter_id`` (from ``peer`` and the swarm) and load it as ``name``; the reply names slot and evicted adapter.

        ``stage_only``: pull into the store, load no slot; ``named_peer_only``: pull from ``peer`` alone, not the swarm."""
        request = fabric_pb2.PromoteRequest(
            peer=peer, adapter_id=adapter_id, name=name, pin=pin, stage_only=stage_only, named_peer_only=named_peer_only
        )
        if peft is not None:
            request.peft.CopyFrom(peft)
        return self._call(self.stub.Promote, request)

    def locate(self, adapter_id: str = "", digest: str = "") -> fabric_pb2.LocateResponse:
        """Which of the node's known peers hold an adapter, fully or in part."""
        return self._call(self.stub.Locate, fabric_pb2.LocateRequest(adapter_id=adapter_id, digest=digest))

    def availability(self, digest: str) -> fabric_pb2.AvailabilityResponse:
        """Which chunks of ``digest`` the node holds verified (also while it is still receiving them)."""
        return self._call(self.stub.Availability, fabric_pb2.AvailabilityRequest(digest=digest))

    def list(self) -> fabric_pb2.ListAdaptersResponse:
        """The node's staged adapters and its slots (name, content id, refs, pin, active)."""
        return self._call(self.stub.ListAdapters, fabric_pb2.ListAdaptersRequest())

    def set_active(self, name: str) -> fabric_pb2.SetActiveResponse:
        """Make a resident adapter the node's active one (what slot -1 means)."""
        return self._call(self.stub.SetActive, fabric_pb2.SetActiveRequest(name=name))

    def pin(self, name: str, pinned: bool = True) -> int:
        """Pin (or unpin) a resident adapter against eviction; returns its slot. At most slots - 1 may be pinned."""
        return self._call(self.stub.Pin, fabric_pb2.PinRequest(name=name, pinned=pinned)).slot

    def generate(self, input_ids: list[int], adapter: str = "", *, use_base: bool = False, max_new_tokens: int = 0, return_logits: bool = False) -> GenerateResult:
        """Run the node's model on ``input_ids`` with a resident adapter (or the base model); greedy tokens and, if asked, the last logits."""
        reply = self._call(
            self.stub.Generate,
            fabric_pb2.GenerateRequest(adapter=adapter, use_base=use_base, input_ids=input_ids, max_new_tokens=max_new_tokens, return_logits=return_logits),
        )
        return GenerateResult(list(reply.output_ids), list(reply.last_logits), reply.slot, reply.content_id)
