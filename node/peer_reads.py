"""The peer-facing reads of the servicer: Fetch (chunks, with super-seeding) and Availability.

A mixin of ``FabricServicer``: it uses the servicer's store, thread pools and
limits, and serves only verified bytes (committed blobs, or the verified
chunks of a partial download).
"""

from __future__ import annotations

import logging
import os
from typing import AsyncIterator, Callable, Sequence

from fabric.errors import AdapterNotFound, InvalidArgument, QuotaExceeded
from fabric.observability.metrics import SERVED_BYTES
from fabric.rpc.status import rpc_errors
from fabric.store.manifest import Manifest
from fabric.transport import fetch_metadata, swarm, wire
from fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.node")

#: adapters whose per-chunk hand-out counts are kept for super-seeding (least recently served dropped)
SENT_COUNTS_KEPT = 16


class PeerReads:
    """Fetch and Availability, mixed into ``FabricServicer``."""

    @rpc_errors
    async def Fetch(self, request: fabric_pb2.FetchRequest, context) -> AsyncIterator[bytes]:
        holder = fetch_metadata.holder_of(context.invocation_metadata(), context.peer())
        if holder is not None and request.digest:
            self.puller.hint(request.digest, *holder)  # the caller pulls it too: news for our own pull of it
        partial = self.store.partial_for(request.digest) if request.digest and self.store.by_digest(request.digest) is None else None
        if partial is not None:
            async for message in self._fetch_partial(partial, request, context):
                yield message
            return
        manifest = self._manifest_for(request.adapter_id, request.digest)
        self._check_stored(manifest)  # a node that trusts signers serves only signed adapters
        entry = manifest.file(request.file) if request.file else manifest.weights
        if request.offset % entry.chunk_size:
            raise InvalidArgument(f"Fetch offset {request.offset} is not a multiple of the chunk size {entry.chunk_size}")
        if request.offset > entry.size:
            raise InvalidArgument(f"Fetch offset {request.offset} is past the end of {entry.name} ({entry.size} bytes)")
        end = entry.size if request.length == 0 else min(entry.size, request.offset + request.length)
        chunks: Sequence[int] = range(request.offset // entry.chunk_size, -(-end // entry.chunk_size))
        if request.accept_bitmap and entry.name == manifest.weights.name:
            async for message in self._seed(manifest, chunks, request, context):
                yield message
            return
        path = await self._io(self.store.verified_blob, manifest, entry)  # bytes at rest are re-verified before they leave
        with open(path, "rb") as f:
            for index in chunks:
                offset, length = entry.chunk_span(index)
                if self._upload_limit is not None:
                    await self._upload_limit.acquire(min(length, self._upload_limit.max_rate))
                data = await self._io(os.pread, f.fileno(), length, offset)
                SERVED_BYTES.inc(len(data))
                yield wire.encode_chunk(offset, data)
        context.set_trailing_metadata(fetch_metadata.complete())

    async def _seed(self, manifest: Manifest, requested: Sequence[int], request: fabric_pb2.FetchRequest, context) -> AsyncIterator[bytes]:
        """A swarm request to a node holding the whole adapter: super-seeding.

        It gets the acceptable chunks handed out least. While first copies
        are still on their way to other nodes and this caller takes only
        chunks handed out already, it is told to ask again (busy): the seed's
        upload carries every chunk once before it carries any twice, and the
        caller gets the rest from the nodes that received them.
        """
        weights, digest = manifest.weights, manifest.digest
        accept = swarm.bitmap_to_chunks(request.accept_bitmap, weights.chunk_count) | set(requested)
        sent = self._sent_counts(digest, weights.chunk_count)
        first_inflight = self._first_inflight.setdefault(digest, set())
        if first_inflight and all(sent[c] for c in accept):
            raise QuotaExceeded(
                f"every chunk of {digest} the caller takes has left this node already and {len(first_inflight)} first copies are on their way: "
                f"fetch from the nodes that received them, or ask again shortly"
            )
        fresh = {c for c in accept if sent[c] == 0}
        chunks = swarm.pick_chunks(requested, accept, lambda c: True, sent, self._rng)
        firsts = [c for c in chunks if c in fresh]
        first_inflight.update(firsts)
        served: set[int] = set()
        try:
            await context.send_initial_metadata(fetch_metadata.picked(chunks))
            with open(await self._io(self.store.verified_weights, manifest), "rb") as f:
                for index in chunks:
                    offset, length = weights.chunk_span(index)
                    if self._upload_limit is not None:
                        await self._upload_limit.acquire(min(length, self._upload_limit.max_rate))
                    data = await self._io(os.pread, f.fileno(), length, offset)
                    SERVED_BYTES.inc(len(data))
                    served.add(index)  # handed to gRPC: a caller that cuts the stream after it may hold it already
                    yield wire.encode_chunk(offset, data)
            context.set_trailing_metadata(fetch_metadata.complete())
        finally:
            first_inflight.difference_update(firsts)
            for index in chunks:
                if index not in served:
                    sent[index] -= 1  # cut before it left: not handed out after all

    def _sent_counts(self, digest: str, chunk_count: int) -> list[int]:
        """How often each chunk of ``digest`` was handed out to swarm requests (kept for the most recently served adapters)."""
        sent = self._sent.pop(digest, None) or [0] * chunk_count
        self._sent[digest] = sent  # most recently used last
        while len(self._sent) > SENT_COUNTS_KEPT:
            evicted = next(iter(self._sent))
            del self._sent[evicted]
            self._first_inflight.pop(evicted, None)
        return sent

    def _pick(self, digest: str, chunk_count: int, requested: Sequence[int], accept_bitmap: bytes, holds: Callable[[int], bool]) -> list[int]:
        """Super-seeding (fabric.transport.swarm.pick_chunks): the chunks this node has handed out least, among those the caller takes."""
        sent = self._sent_counts(digest, chunk_count)
        return swarm.pick_chunks(requested, swarm.bitmap_to_chunks(accept_bitmap, chunk_count), holds, sent, self._rng)

    async def _fetch_partial(self, partial, request: fabric_pb2.FetchRequest, context) -> AsyncIterator[bytes]:
        """Chunks of an adapter still arriving here: only verified ones, and the whole range must be verified up front."""
        self._check_stored(partial.manifest)
        weights = partial.manifest.weights
        if request.file and request.file != weights.name:
            raise AdapterNotFound(f"{request.file} of {request.digest} is not here yet (only {weights.name} is served while it arrives)")
        if request.offset % weights.chunk_size or request.offset >= weights.size:
            raise InvalidArgument(f"Fetch offset {request.offset} is not a chunk boundary inside {weights.name} ({weights.size} bytes, chunks of {weights.chunk_size})")
        end = weights.size if request.length == 0 else min(weights.size, request.offset + request.length)
        chunks: Sequence[int] = range(request.offset // weights.chunk_size, (end + weights.chunk_size - 1) // weights.chunk_size)
        verified = partial.verified_chunks
        if request.accept_bitmap:
            chunks = self._pick(request.digest, weights.chunk_count, chunks, request.accept_bitmap, verified.__contains__) or chunks
        missing = [i for i in chunks if i not in verified]
        if missing:
            # NOT_FOUND, not an error of the caller: its view of our chunks is stale; it asks another peer.
            raise AdapterNotFound(
                f"chunk {missing[0]} of {request.digest} is not verified on this node yet ({len(verified)} of {weights.chunk_count} are): "
                f"ask Availability again, or fetch it from another peer"
            )
        if request.accept_bitmap:
            await context.send_initial_metadata(fetch_metadata.picked(chunks))
        for index in chunks:
            if self._upload_limit is not None:
                await self._upload_limit.acquire(min(weights.chunk_span(index)[1], self._upload_limit.max_rate))
            try:
                data = await self._io(partial.read_chunk, index)  # re-verified on read
            except InvalidArgument as exc:  # the partial was closed under us (its pull failed)
                raise AdapterNotFound(f"chunk {index} of {request.digest} is no longer served here: {exc}") from None
            SERVED_BYTES.inc(len(data))
            yield wire.encode_chunk(index * weights.chunk_size, data)
        # What it holds by now, so a swarm puller need not poll Availability (fabric.transport.swarm_pull).
        held = fetch_metadata.complete() if partial.committed else fetch_metadata.verified(partial.verified_bitmap)
        context.set_trailing_metadata(held)

    @rpc_errors
    async def Availability(self, request, context) -> fabric_pb2.AvailabilityResponse:
        manifest = self.store.by_digest(request.digest)
        if manifest is not None:
            count = manifest.weights.chunk_count
            return fabric_pb2.AvailabilityResponse(complete=True, chunk_count=count, verified_bitmap=swarm.chunks_to_bitmap(range(count), count))
        partial = self.store.partial_for(request.digest)
        if partial is None:
            raise AdapterNotFound(f"no adapter with digest {request.digest} is staged or arriving here")
        return fabric_pb2.AvailabilityResponse(complete=False, chunk_count=partial.manifest.weights.chunk_count, verified_bitmap=partial.verified_bitmap)
