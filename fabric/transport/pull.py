"""The peer client: pull a staged adapter from peers into the local store.

A pull asks peers for the manifest, lets the caller check it against this
node's model before a byte moves, then fetches the weights file in runs of
chunks into the store's partial area, spread over every peer that holds them
(a swarm: ``adapter_fabric.transport.swarm`` decides who is asked for what; peers still
receiving the adapter announce their verified chunks through Availability).
Every chunk is verified before it is written, and only verified chunks are
ever served on. A dead or stalled peer is dropped and its chunks are asked of
the others; a restarted pull resumes from the chunks already verified; a peer
that sends corrupt bytes is asked again and, when it keeps doing so, dropped.
Commit checks the whole file's digest.

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
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

from adapter_fabric.errors import AdapterNotFound, FabricError
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import MakeRoom, opened_with_room
from adapter_fabric.transport import peer_calls, swarm
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.pull_values import STALL_TIMEOUT_S, PullSettings, PullStats
from adapter_fabric.transport.rate import TokenBucket
from adapter_fabric.transport.swarm_pull import SwarmPull
from adapter_fabric.trust.signing import Signed
from adapter_fabric.v1 import fabric_pb2

__all__ = ["ManifestCheck", "SinkFor", "PeerChannels", "PeerPuller", "PullSettings", "PullStats", "STALL_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: sees a peer's manifest and the signatures it carries (unverified; none when unsigned) before any byte moves; raises to refuse the pull
ManifestCheck = Callable[[Manifest, tuple[Signed, ...]], None]
#: after the check: an object whose ``add(index, data)`` sees each verified chunk as it lands (``PartialDownload.attach``), or None
SinkFor = Callable[[Manifest], Any]
#: whether the caller a pull runs for may have the bytes of a digest this node holds (committed, or partly downloaded) put under
#: its id without moving them; False: every chunk is fetched again from the peers and verified, as a proof that they hold them
MayReuse = Callable[[str], bool]


class _Proving:
    """A partial seen by a swarm download as holding nothing: every chunk is fetched and verified again (then written where
    missing). A pull for a caller that may not take the bytes held here proves, chunk by chunk, that its peers hold them."""

    def __init__(self, partial: Any) -> None:
        self._partial = partial
        self._chunk_count = partial.manifest.weights.chunk_count
        self.verified_chunks: set[int] = set()

    @property
    def verified_bitmap(self) -> bytes:
        return swarm.chunks_to_bitmap(self.verified_chunks, self._chunk_count)

    def write_chunk(self, index: int, data: bytes | memoryview) -> None:
        self._partial.write_chunk(index, data)  # verifies first (IntegrityError), then writes only what was missing
        self.verified_chunks.add(index)


class PeerPuller:
    """Pulls adapters from peers into one store; safe to call from many threads.

    A pull spreads its chunks over every given peer that holds them (see
    ``adapter_fabric.transport.swarm`` for the policy); peers that hold part of the adapter
    (they are pulling it too) announce their verified chunks through
    Availability, so a rollout forms a pipeline rather than a star.
    """

    def __init__(
        self,
        store: AdapterStore,
        channels: PeerChannels | None = None,
        stall_timeout: float = STALL_TIMEOUT_S,
        download_rate: int = 0,
        window: int | None = None,
        listen_port: int = 0,
        make_room: MakeRoom | None = None,
    ) -> None:
        """``make_room``: asked when the store refuses a download for room (an evicting node's ``Evictor.make_room``); None: refused."""
        self.store = store
        self.make_room = make_room
        self.settings = PullSettings(stall_timeout=stall_timeout, window=window, listen_port=listen_port, download_rate=download_rate)
        self._pulls: dict[str, SwarmPull] = {}  # downloads in progress, by digest (for hints from peers that fetch from us)
        self.channels = channels or PeerChannels()
        # One bucket for every pull of this node: the flag bounds what it receives in total.
        self.download_limit = TokenBucket(download_rate) if download_rate > 0 else None
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ manifest

    def manifest(self, peers: Sequence[str], adapter_id: str) -> tuple[Manifest, str, tuple[Signed, ...]]:
        """The manifest from the first peer that has it, that peer's address, and the signatures it carries (unverified)."""
        return peer_calls.first_manifest(self.channels, peers, adapter_id)

    # ------------------------------------------------------------ availability

    def holding(self, peer: str, digest: str) -> peer_calls.Holding:
        """``(verified chunks, complete, chunk count)`` of ``digest`` on ``peer``; nothing held = ``(set(), False, 0)``.

        Raises PeerUnavailable (or another FabricError) when the peer cannot answer.
        """
        return peer_calls.holding(self.channels, peer, digest)

    def availability(self, peer: str, digest: str) -> fabric_pb2.PeerHolding | None:
        """What ``peer`` holds of ``digest`` for a Locate answer; None when nothing, or when it does not answer."""
        try:
            have, complete, _ = self.holding(peer, digest)
        except FabricError as exc:
            log.info("locate: %s did not answer: %s", peer, exc)
            return None
        if not complete and not have:
            return None
        return fabric_pb2.PeerHolding(address=peer, complete=complete, verified_chunks=len(have))

    # ---------------------------------------------------------------- pull

    def pull(
        self,
        peers: Sequence[str],
        adapter_id: str,
        check: ManifestCheck | None = None,
        sink_for: SinkFor | None = None,
        *,
        complete: Collection[str] = (),
        behalf: str = "",
        may_reuse: MayReuse | None = None,
    ) -> tuple[Manifest, PullStats]:
        """Fetch ``adapter_id`` from ``peers`` (in order of preference) and commit it under that id.

        The manifest comes from the first peer that has the adapter; the
        chunks from every peer that holds them. ``check`` sees the manifest
        and its signatures before any bytes move (trust, model compatibility,
        the caller's PEFT fields); an error it raises ends the pull with
        nothing written. ``sink_for(manifest)`` may give a sink that sees every
        verified chunk of this download as it lands (a slot row staged while
        receiving); a pull that moves no bytes (they are here already, or
        another caller's download is joined) feeds it nothing. ``complete``: peers known to hold the whole adapter (a
        lookup asked them): the download takes chunks from them without asking what they hold.

        ``behalf``: the identity of the caller the pull runs for (``PeerChannels.for_caller``): every peer call to a member
        names it, so holders give only what that caller may pull there. ``may_reuse``: whether that caller may have bytes
        held here put under ``adapter_id`` without moving them (None: always); where not, they are fetched and verified again.
        """
        channels = self.channels.for_caller(behalf)
        manifest, first, signatures = peer_calls.first_manifest(channels, peers, adapter_id)
        if check is not None:
            check(manifest, signatures)
        sink = sink_for(manifest) if sink_for is not None else None
        ordered = [first] + [p for p in dict.fromkeys(peers) if p != first]
        return self._single_flight(manifest, ordered, sink, channels, may_reuse, complete=frozenset(complete))

    def _single_flight(
        self, manifest: Manifest, peers: list[str], sink: Any, channels: PeerChannels, may_reuse: MayReuse | None, attempts: int = 2,
        complete: frozenset[str] = frozenset(),
    ) -> tuple[Manifest, PullStats]:
        with self._lock:
            running = self._inflight.get(manifest.digest)  # another caller's download of the digest, to join
            if running is None:
                future: Future = Future()
                self._inflight[manifest.digest] = future
        if running is not None:
            committed, stats = running.result()
            joined = PullStats(digest=stats.digest, source_peers=list(stats.source_peers), shared=True)
            if self._has_ref(manifest):
                return self.store.get(manifest.adapter_id), joined
            if may_reuse is not None and not may_reuse(manifest.digest):
                # Another caller's download: this one may not take its bytes, so its own peers must prove they hold them.
                return self._single_flight(manifest, peers, sink, channels, may_reuse, attempts)
            try:
                joined.referred = True
                return self._commit_existing(manifest), joined
            except AdapterNotFound:
                if attempts <= 1:
                    raise
            # The bytes left between that download's commit and this caller's reference (an unstage raced it): again.
            return self._single_flight(manifest, peers, sink, channels, may_reuse, attempts - 1, complete)
        try:
            result = self._download(manifest, peers, sink, channels, may_reuse, complete)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(result)
            return result
        finally:
            with self._lock:
                self._inflight.pop(manifest.digest, None)

    def hint(self, digest: str, host: str, port: int, bitmap: bytes) -> None:
        """A peer at ``host:port`` that fetches from this node holds ``bitmap`` of ``digest``: news for our own pull of it, if any."""
        with self._lock:
            download = self._pulls.get(digest)
        if download is not None:
            download.hint(host, port, bitmap)

    def _has_ref(self, manifest: Manifest) -> bool:
        try:
            return self.store.get(manifest.adapter_id).digest == manifest.digest
        except AdapterNotFound:
            return False

    def _commit_existing(self, manifest: Manifest) -> Manifest:
        """A reference to bytes found committed here; ``AdapterNotFound`` when they left meanwhile (nothing is changed, and
        no download is opened: one another pull has under way for the digest is never touched)."""
        return self.store.refer(manifest)

    def _download(
        self, manifest: Manifest, peers: list[str], sink: Any, channels: PeerChannels, may_reuse: MayReuse | None,
        complete: frozenset[str] = frozenset(),
    ) -> tuple[Manifest, PullStats]:
        """``peers[0]`` served the manifest, so it holds every chunk; the others say what they hold."""
        stats = PullStats(digest=manifest.digest)
        held = self.store.by_digest(manifest.digest) is not None
        # Asked only when bytes of the digest are here (committed, or partly downloaded): else there is nothing to reuse.
        here = held or self.store.arriving(manifest.digest)
        prove = may_reuse is not None and here and not may_reuse(manifest.digest)
        if not prove and held:
            # The bytes are here already (another id, or an earlier pull), and the caller may have them: only the reference is new.
            try:
                stats.referred = not self._has_ref(manifest)
                return self._commit_existing(manifest), stats
            except AdapterNotFound:
                pass  # they left between the look and the reference (an unstage, an eviction): downloaded again below
        started = time.monotonic()
        partial = opened_with_room(lambda: self.store.open_partial(manifest), self.make_room)
        stats.resumed_from = 0 if prove else partial.verified_offset
        fed = sink is not None and not partial.committed
        if fed:
            partial.attach(sink)  # chunks a resume found verified are read back for it once
        try:
            if prove or not partial.complete:
                download = SwarmPull(
                    manifest, _Proving(partial) if prove else partial, peers, stats,
                    settings=self.settings, channels=channels, download_limit=self.download_limit,
                    holding=lambda peer, digest: peer_calls.holding(channels, peer, digest), complete=complete,
                )
                with self._lock:
                    self._pulls[manifest.digest] = download
                try:
                    download.run()
                finally:
                    with self._lock:
                        self._pulls.pop(manifest.digest, None)
            committed = partial.commit(manifest.adapter_id)
            stats.referred = True
        finally:
            if fed:
                partial.detach(sink)
        stats.pull_seconds = time.monotonic() - started
        return committed, stats
