"""Small adapters published on one StageMany stream (``NodeClient.stage_many``'s path for adapters of one upload piece).

Each request carries one whole adapter: its StageBegin, its weights and the
digest they have at the node's chunk size (asked once per stream, by
UploadOffset). The node answers each adapter as its group commits (durable) or
refuses it by name; ``done`` hears each once. A stream that breaks (the node
restarts, the connection drops) or is refused ``Busy`` is opened again for the
adapters not answered yet, a few times: a second send of a committed adapter is
the same digest again (``already_staged``), so nothing is lost and nothing is
answered twice. A node without StageMany (UNIMPLEMENTED: an older node) leaves
the adapters to the per-adapter Stage path, logged once per process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from blake3 import blake3

from adapter_fabric.client.adapter_dir import adapter_files
from adapter_fabric.client.results import StageResult
from adapter_fabric.errors import Busy, FabricError, PeerUnavailable
from adapter_fabric.format.config import CONFIG_FILE
from adapter_fabric.rpc.status import error_from_detail
from adapter_fabric.store.digests import DIGEST_SCHEME, WEIGHTS_FILE, adapter_digest, hash_bytes
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.client")

#: streams opened again for the adapters a broken (or Busy) stream left unanswered, and the first wait before one
RESENDS = 4
RESEND_WAIT_S = 0.5
#: adapters one stream carries (the node's bound: ``adapter_fabric.node.stage_many.MAX_ADAPTERS_PER_CALL``)
STREAM_ADAPTERS = 100_000

Done = Callable[[str, StageResult | None, FabricError | None], None]

_fallbacks = 0  # StageMany calls answered UNIMPLEMENTED in this process (logged at the first)
_fallbacks_lock = threading.Lock()


def fallbacks() -> int:
    """How many times this process found a node without StageMany and staged its adapters one Stage each."""
    return _fallbacks


class StreamStage:
    """Publishes ``(directory, adapter_id)`` pairs of one upload piece each on StageMany streams of ``client`` (a ``NodeClient``)."""

    def __init__(self, client: Any, timeout: float | None) -> None:
        self.client = client
        self.timeout = timeout

    def __call__(self, pairs: list[tuple[Path, str]], done: Done) -> list[tuple[Path, str]]:
        """Stage every pair, calling ``done`` once for each; the pairs left for per-adapter Stage calls (a node without StageMany)."""
        answered: set[str] = set()
        for start in range(0, len(pairs), STREAM_ADAPTERS):
            left = self._publish(pairs[start : start + STREAM_ADAPTERS], done, answered)
            if left:
                return left + pairs[start + STREAM_ADAPTERS :]
        return []

    def _publish(self, pairs: list[tuple[Path, str]], done: Done, answered: set[str]) -> list[tuple[Path, str]]:
        """One batch of pairs, streams opened again while some are unanswered; the pairs left when StageMany is unimplemented."""
        error: FabricError | None = None
        for attempt in range(RESENDS + 1):
            waiting = [(d, i) for d, i in pairs if i not in answered]
            if not waiting:
                return []
            if attempt:
                time.sleep(RESEND_WAIT_S * 2 ** (attempt - 1))
            try:
                self._stream(waiting, done, answered)
                return []
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and not answered.intersection(i for _, i in waiting):
                    _fell_back(self.client.address)
                    return waiting
                error = self.client.error_of(exc)
            except FabricError as exc:  # asking the chunk size failed (the node is away, or refuses)
                error = exc
            if error is not None and not isinstance(error, (Busy, PeerUnavailable)) and not error.retryable:
                break  # the stream itself was refused (a permission, a bound): sending it again changes nothing
        failure = error or PeerUnavailable(f"node {self.client.address}: StageMany ended before answering every adapter")
        for _, adapter_id in pairs:
            if adapter_id not in answered:
                answered.add(adapter_id)
                done(adapter_id, None, failure)
        return []

    def _stream(self, pairs: list[tuple[Path, str]], done: Done, answered: set[str]) -> None:
        """One StageMany stream of ``pairs``: each answer handed to ``done`` (an adapter whose files cannot be read: at once)."""
        directory, first = pairs[0]
        target = self.client.upload_target(first, _whole_blake3(directory / WEIGHTS_FILE))
        lock = threading.Lock()  # done runs on this thread and on gRPC's request thread (a local refusal)

        def tell(adapter_id: str, result: StageResult | None, error: FabricError | None) -> None:
            with lock:
                if adapter_id in answered:
                    return  # answered on an earlier stream already
                answered.add(adapter_id)
            done(adapter_id, result, error)

        def requests() -> Iterator[fabric_pb2.StageManyRequest]:
            for directory, adapter_id in pairs:
                try:
                    request = stage_many_request(directory, adapter_id, target.chunk_size)
                except FabricError as exc:
                    tell(adapter_id, None, exc)
                    continue
                except OSError as exc:  # a file gone or unreadable meanwhile
                    tell(adapter_id, None, FabricError(f"{directory}: {exc}"))
                    continue
                yield request

        for reply in self.client.stub.StageMany(requests(), timeout=self.client.long_deadline(self.timeout)):
            if reply.HasField("staged"):
                r = reply.staged
                tell(reply.adapter_id, StageResult(r.adapter_id, r.digest, r.content_id, r.bytes_received, r.already_staged), None)
            else:
                error = error_from_detail(reply.error.SerializeToString()) or FabricError(reply.error.message)
                tell(reply.adapter_id, None, error)


def stage_many_request(directory: Path, adapter_id: str, chunk_size: int) -> fabric_pb2.StageManyRequest:
    """One adapter whole, with the digest its files have at ``chunk_size``."""
    config_path, weights_path = adapter_files(directory)
    config, weights = config_path.read_bytes(), weights_path.read_bytes()
    weights_root = hash_bytes(WEIGHTS_FILE, weights, chunk_size).root
    begin = fabric_pb2.StageBegin(
        adapter_id=adapter_id, config_json=config, safetensors_size=len(weights), safetensors_blake3=blake3(weights).hexdigest(),
        weights_root=weights_root, digest_scheme=DIGEST_SCHEME,
    )
    digest = adapter_digest(hash_bytes(CONFIG_FILE, config, chunk_size).root, weights_root)
    return fabric_pb2.StageManyRequest(begin=begin, data=weights, digest=digest)


def _whole_blake3(path: Path) -> str:
    try:
        return blake3(path.read_bytes()).hexdigest()
    except OSError:
        return "0" * 64  # names no upload: the node answers its chunk size all the same


def _fell_back(address: str) -> None:
    global _fallbacks
    with _fallbacks_lock:
        _fallbacks += 1
        first = _fallbacks == 1
    if first:
        log.warning("node %s has no StageMany (an older node): small adapters are staged one Stage call each", address)
