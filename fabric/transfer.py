"""The peer client: pull a staged adapter from peers into the local store.

A pull asks peers for the manifest, lets the caller check it against this
node's model before a byte moves, then streams the weights file chunk by chunk
into the store's partial area. Every chunk is verified before it is written;
a broken stream resumes from the last verified offset, on the same peer or the
next one that answers; a peer that sends corrupt bytes is asked again and,
when it keeps doing so, dropped. Commit checks the whole file's digest.

Concurrent pulls of one adapter on one node share one download (single
flight, keyed by digest), so its bytes cross the network once.

The client is synchronous on purpose: it runs on worker threads of the node
(never under the model lock) and also backs the library-level
``promote_lora_from_peer``, which is a plain blocking call.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import grpc

from fabric import wire
from fabric.errors import AdapterNotFound, FabricError, IntegrityError, PeerUnavailable
from fabric.ids import validate_adapter_id
from fabric.manifest import Manifest
from fabric.status import error_from_rpc
from fabric.store import AdapterStore
from fabric.v1 import fabric_pb2, fabric_pb2_grpc

log = logging.getLogger(__name__)

#: a chunk that fails verification is asked for again this many times per peer before moving on
CORRUPT_RETRIES_PER_PEER = 2
#: seconds for a manifest call; a dead peer answers UNAVAILABLE long before this
MANIFEST_TIMEOUT_S = 10.0
#: a peer that sends nothing for this long is cancelled and the pull moves on (a slow peer that keeps sending is fine)
STALL_TIMEOUT_S = 10.0


@dataclass
class PullStats:
    """What one pull did: what it moved and from whom (for logs, tests and the Promote reply)."""

    digest: str = ""
    bytes_transferred: int = 0
    resumed_from: int = 0
    source_peers: list[str] = field(default_factory=list)
    corrupt_chunks: int = 0
    failovers: int = 0
    shared: bool = False  # this caller joined a download another caller started


class PeerChannels:
    """One long-lived channel per peer address (channels are expensive; connections are reused)."""

    def __init__(self, options: Sequence[tuple[str, object]] = wire.CHANNEL_OPTIONS, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._options = list(options)
        self._credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                if self._credentials is not None:
                    channel = grpc.secure_channel(address, self._credentials, options=self._options)
                else:
                    channel = grpc.insecure_channel(address, options=self._options)
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class PeerPuller:
    """Pulls adapters from peers into one store; safe to call from many threads."""

    def __init__(self, store: AdapterStore, channels: PeerChannels | None = None, stall_timeout: float = STALL_TIMEOUT_S) -> None:
        self.store = store
        self.channels = channels or PeerChannels()
        self.stall_timeout = stall_timeout
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ manifest

    def manifest(self, peers: Sequence[str], adapter_id: str) -> tuple[Manifest, str]:
        """The manifest from the first peer that has it, and that peer's address."""
        validate_adapter_id(adapter_id)
        if not peers:
            raise PeerUnavailable(f"no peer to pull {adapter_id!r} from: give a peer address")
        missing: list[str] = []
        failures: list[str] = []
        for peer in peers:
            stub = fabric_pb2_grpc.FabricStub(self.channels.get(peer))
            try:
                reply = stub.GetManifest(fabric_pb2.GetManifestRequest(adapter_id=adapter_id), timeout=MANIFEST_TIMEOUT_S)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, peer=peer)
                if isinstance(error, AdapterNotFound):
                    missing.append(peer)
                else:
                    failures.append(f"{peer}: {error}")
                continue
            manifest = Manifest.from_proto(reply)  # checks that the manifest is self-consistent
            if manifest.adapter_id != adapter_id:
                raise IntegrityError(f"peer {peer} answered for {manifest.adapter_id!r} when asked for {adapter_id!r}")
            return manifest, peer
        if missing and not failures:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not staged on {', '.join(missing)}: stage it there first, or name a peer that has it")
        raise PeerUnavailable(f"no peer could serve the manifest of {adapter_id!r}: " + "; ".join(failures + [f"{p}: not staged" for p in missing]))

    # ---------------------------------------------------------------- pull

    def pull(
        self,
        peers: Sequence[str],
        adapter_id: str,
        check: Callable[[Manifest], None] | None = None,
    ) -> tuple[Manifest, PullStats]:
        """Fetch ``adapter_id`` from ``peers`` (tried in order) and commit it under that id.

        ``check`` sees the manifest before any bytes move (model compatibility,
        the caller's PEFT fields); an error it raises ends the pull with nothing
        written.
        """
        manifest, first = self.manifest(peers, adapter_id)
        if check is not None:
            check(manifest)
        ordered = [first] + [p for p in peers if p != first]
        return self._single_flight(manifest, ordered)

    def _single_flight(self, manifest: Manifest, peers: list[str]) -> tuple[Manifest, PullStats]:
        with self._lock:
            future = self._inflight.get(manifest.digest)
            leader = future is None
            if leader:
                future = Future()
                self._inflight[manifest.digest] = future
        if not leader:
            committed, stats = future.result()
            joined = PullStats(digest=stats.digest, source_peers=list(stats.source_peers), shared=True)
            return self.store.get(manifest.adapter_id) if self._has_ref(manifest) else self._commit_existing(manifest), joined
        try:
            result = self._download(manifest, peers)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(result)
            return result
        finally:
            with self._lock:
                self._inflight.pop(manifest.digest, None)

    def _has_ref(self, manifest: Manifest) -> bool:
        try:
            return self.store.get(manifest.adapter_id).digest == manifest.digest
        except AdapterNotFound:
            return False

    def _commit_existing(self, manifest: Manifest) -> Manifest:
        partial = self.store.open_partial(manifest)
        return partial.commit(manifest.adapter_id)

    def _download(self, manifest: Manifest, peers: list[str]) -> tuple[Manifest, PullStats]:
        stats = PullStats(digest=manifest.digest)
        if self.store.by_digest(manifest.digest) is not None:
            # The bytes are here already (another id, or an earlier pull): only the reference is new.
            return self._commit_existing(manifest), stats
        partial = self.store.open_partial(manifest)
        stats.resumed_from = partial.verified_offset
        weights = manifest.weights
        failures: list[str] = []
        for peer in peers:
            if partial.verified_offset >= weights.size:
                break
            corrupt_here = 0
            while partial.verified_offset < weights.size:
                try:
                    moved = self._stream_from(peer, manifest, partial)
                    stats.bytes_transferred += moved
                    if peer not in stats.source_peers and moved:
                        stats.source_peers.append(peer)
                except _CorruptChunk as exc:
                    stats.bytes_transferred += exc.moved
                    stats.corrupt_chunks += 1
                    corrupt_here += 1
                    log.warning("corrupt chunk from %s: %s", peer, exc.error)
                    if corrupt_here > CORRUPT_RETRIES_PER_PEER:
                        failures.append(f"{peer}: kept sending corrupt bytes ({exc.error})")
                        break
                except _StreamBroken as exc:
                    stats.bytes_transferred += exc.moved
                    if peer not in stats.source_peers and exc.moved:
                        stats.source_peers.append(peer)
                    failures.append(f"{peer}: {exc.error}")
                    log.warning("stream from %s broke at offset %d: %s", peer, partial.verified_offset, exc.error)
                    break
            if partial.verified_offset < weights.size:
                stats.failovers += 1
        if partial.verified_offset < weights.size:
            raise PeerUnavailable(
                f"pull of {manifest.adapter_id!r} stopped at {partial.verified_offset} of {weights.size} bytes "
                f"(kept for resume): " + "; ".join(failures)
            )
        return partial.commit(manifest.adapter_id), stats

    def _stream_from(self, peer: str, manifest: Manifest, partial) -> int:
        """Stream from the verified offset to the end; returns the bytes moved."""
        weights = manifest.weights
        start = partial.verified_offset
        fetch = wire.fetch_stub(self.channels.get(peer))
        request = fabric_pb2.FetchRequest(digest=manifest.digest, file=weights.name, offset=start)
        moved = 0
        call = fetch(request)
        watchdog = _StallWatchdog(call, self.stall_timeout)
        try:
            for offset, data in call:
                watchdog.feed()
                index, rest = divmod(offset, weights.chunk_size)
                if rest or offset != partial.verified_offset:
                    raise _CorruptChunk(IntegrityError(f"peer sent offset {offset}, expected {partial.verified_offset}"), moved)
                moved += len(data)
                try:
                    partial.write_chunk(index, data)
                except IntegrityError as exc:
                    raise _CorruptChunk(exc, moved) from None
        except IntegrityError as exc:  # a malformed Chunk message (fetch_stub cancels the call)
            raise _CorruptChunk(exc, moved) from None
        except grpc.RpcError as exc:
            if watchdog.fired:
                raise _StreamBroken(PeerUnavailable(f"{peer} sent nothing for {self.stall_timeout:g}s: treated as stalled"), moved) from None
            raise _StreamBroken(error_from_rpc(exc, peer=peer), moved) from None
        finally:
            watchdog.close()
            call.cancel()  # no-op when the stream ended; stops the peer's sending when we left early
        if partial.verified_offset < weights.size:
            raise _StreamBroken(PeerUnavailable(f"{peer} ended the stream at {partial.verified_offset} of {weights.size} bytes"), moved)
        return moved


class _StallWatchdog:
    """Cancels a stream that delivers nothing for ``timeout`` seconds (a deadline would also cut slow, healthy peers)."""

    def __init__(self, call, timeout: float) -> None:
        self._call = call
        self._timeout = timeout
        self._last = time.monotonic()
        self._done = threading.Event()
        self.fired = False
        threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()

    def feed(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self._timeout / 4)):
            if time.monotonic() - self._last > self._timeout:
                self.fired = True
                self._call.cancel()
                return


class _CorruptChunk(Exception):
    def __init__(self, error: FabricError, moved: int) -> None:
        self.error, self.moved = error, moved


class _StreamBroken(Exception):
    def __init__(self, error: FabricError, moved: int) -> None:
        self.error, self.moved = error, moved
