"""The peer-facing reads: GetManifest, Locate, Fetch (chunks, with super-seeding) and Availability.

Only verified bytes are served (committed blobs, re-verified on read, or the
verified chunks of a partial download), and, on a node that trusts signers,
only signed adapters. These are the calls --auth-peer-reads guards.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import IO

import grpc
from aiolimiter import AsyncLimiter

from adapter_fabric.errors import FIRST_COPIES_BOUND, AdapterNotFound, InvalidArgument, PeerUnavailable, QuotaExceeded
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.origin_fetch import OriginFetches
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.node.upload_slots import UPLOAD_SLOTS, UploadSlots
from adapter_fabric.observability.metrics import PARTIAL_CHUNKS_SERVED, SERVED_BYTES
from adapter_fabric.store.digests import check_scheme
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport import fetch_metadata, swarm, wire
from adapter_fabric.transport.pull import PeerPuller
from adapter_fabric.transport.recent_pullers import RecentPullers
from adapter_fabric.trust.signing import signatures_to_proto
from adapter_fabric.v1 import fabric_pb2

#: adapters whose per-chunk hand-out counts are kept for super-seeding (least recently served dropped)
SENT_COUNTS_KEPT = 16
#: seconds before the drain bound (--drain-timeout) at which streams still sending end, naming the cause (at most half the bound)
DRAIN_CUT_MARGIN_S = 1.0


# What a Fetch sends, whichever channel carries it (gRPC here, the data channel in node.data_server).
@dataclass(frozen=True)
class FilePiece:
    """``length`` bytes at ``offset`` of a committed blob verified at rest (``file`` stays open until the next piece is asked for)."""

    offset: int
    length: int
    file: IO[bytes]


@dataclass(frozen=True)
class BytesPiece:
    """A verified chunk of a download still arriving here, read into memory."""

    offset: int
    data: bytes


@dataclass(frozen=True)
class Picked:
    """The chunks a super-seeding node will send (first, before any bytes), and how many others pull it from here."""

    chunks: list[int]
    others: int | None = None  # recent_pullers; None: not said (a partial's pick, or an unnamed puller)


@dataclass(frozen=True)
class Holds:
    """The stream ended well: what this node holds now (every chunk, or the verified bitmap of a partial)."""

    complete: bool
    bitmap: bytes | None = None


Piece = FilePiece | BytesPiece | Picked | Holds


def _open_blob(path: os.PathLike | str, manifest: Manifest) -> IO[bytes]:
    """A verified blob opened to serve; ``AdapterNotFound`` when it went since it was verified (unstaged or evicted: not damage)."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise AdapterNotFound(f"adapter {manifest.adapter_id!r} ({manifest.digest[:12]}) was unstaged or evicted here meanwhile; fetch it from another peer") from None


class PeerReads:
    """GetManifest, Locate, Fetch and Availability; owns the upload rate limit and the super-seeding counts."""

    def __init__(
        self, context: NodeContext, puller: PeerPuller, signed: SignedAdapters, upload_rate: int = 0, durable: bool = False,
        announce: tuple[tuple[str, str], ...] = (), origins: OriginFetches | None = None,
        homes: Homes | None = None, streams_open: Callable[[], int] = lambda: 0, upload_slots: int = UPLOAD_SLOTS,
    ) -> None:  # fmt: skip
        """``announce``: metadata naming this node's data channel port (``fetch_metadata.announce_data_port``), sent in replies.
        ``origins``: where ids fetched from an origin came from (GetManifest names the revision). ``homes``: this node's
        part in the fleet (answers a Locate at_home, keeps announcements); ``streams_open``: the Fetch streams it serves
        now, said in every Availability reply (a puller prefers a holder that is not busy); ``upload_slots``: how many of
        them send at once (``node.upload_slots``)."""
        self.context = context
        self.origins = origins
        self.homes = homes
        self.streams_open = streams_open
        #: this node never evicts (--when-full refuse): said in every Availability reply, so peers hand it their last copies
        self.durable = durable
        self.store = context.store
        self.puller = puller
        self.signed = signed
        # One bucket for all streams: --upload-rate bounds what the node serves in total.
        self._upload_limit = AsyncLimiter(upload_rate, 1.0) if upload_rate > 0 else None
        self._slots = UploadSlots(upload_slots)
        # Per digest, how often each chunk was handed out to swarm pulls (super-seeding); touched on the event loop only.
        self._sent: dict[str, list[int]] = {}
        self._first_inflight: dict[str, set[int]] = {}  # per digest: chunks whose first copy is being sent
        self._pullers = RecentPullers()  # per digest, who asked lately: each swarm puller is told how many others did
        self._rng = random.Random()
        self.announce = announce
        self._cut: str = ""  # set while draining, once streams still sending must end: why

    def start_draining(self, bound: float) -> None:
        """SIGTERM: streams in flight have ``bound`` seconds; shortly before the server cuts them, each ends naming the cause.

        A receiver then hears that this peer is shutting down (``PeerUnavailable``, on gRPC and the data channel alike)
        and fetches the rest elsewhere, instead of a bare cancel. Called on the event loop.
        """
        cause = f"this peer is shutting down (SIGTERM; its --drain-timeout of {bound:g}s for streams in flight passed): fetch the rest from another peer"

        def cut() -> None:
            self._cut = cause

        asyncio.get_running_loop().call_later(max(0.0, bound - min(DRAIN_CUT_MARGIN_S, bound / 2)), cut)

    async def get_manifest(self, request: fabric_pb2.GetManifestRequest) -> fabric_pb2.Manifest:
        """A staged adapter's manifest with its signature (and, when asked, each file's sha256)."""
        # A caller of another digest scheme would misread every digest of the answer: refused by name instead.
        check_scheme(request.digest_scheme, f"GetManifest of {request.adapter_id[:200]!r} from a caller that")
        manifest = await self.context.io(self.store.get, validate_adapter_id(request.adapter_id))
        self.signed.check_stored(manifest)  # a node that trusts signers serves only signed adapters
        reply = manifest.to_proto()
        signatures_to_proto(reply, await self.context.io(self.store.signatures_of, manifest.digest))
        if self.origins is not None:  # where the id's digest came from, when an origin (fabric inspect shows it)
            record = await self.context.io(self.origins.record_of, manifest.adapter_id, manifest.digest)
            if record is not None:
                reply.origin, reply.revision = record.revision.origin, record.revision.revision
        if request.with_sha256:
            for name, sha256 in (await self.context.io(self.store.file_sha256, manifest)).items():
                reply.file_sha256[name] = sha256
        return reply

    async def locate(self, request: fabric_pb2.LocateRequest) -> fabric_pb2.LocateResponse:
        """Which known peers hold the adapter, fully or in part (this node itself is not listed); ``at_home``: what this
        node holds and the holders that told it, asking nobody (``node.homes``)."""
        if request.at_home and self.homes is not None:
            return await self.context.io(self.homes.answer, request.adapter_id, request.digest)
        peers = await self.context.known_peers()
        digest = request.digest
        if not digest:
            try:
                digest = self.store.get(validate_adapter_id(request.adapter_id)).digest
            except AdapterNotFound:
                if not peers:  # nothing to ask, now or on a retry: not found (was PeerUnavailable, "retry")
                    raise AdapterNotFound(f"adapter {request.adapter_id!r} is not staged on this node, and it knows no peers to ask (--peers, --peers-dns)") from None
                manifest, _, _ = await self.context.io(self.puller.manifest, peers, request.adapter_id)
                digest = manifest.digest
        holdings = await asyncio.gather(*(self.context.io(self.puller.availability, peer, digest) for peer in peers))
        return fabric_pb2.LocateResponse(digest=digest, peers=[h for h in holdings if h is not None])

    def _manifest_for(self, adapter_id: str, digest: str) -> Manifest:
        if digest:
            manifest = self.store.by_digest(digest)
            if manifest is None:
                raise AdapterNotFound(f"no adapter with digest {digest} is staged here")
            return manifest
        return self.store.get(validate_adapter_id(adapter_id))

    async def _throttle(self, length: int) -> None:
        """Wait for ``length`` bytes of --upload-rate (a chunk larger than a second's worth takes a whole second's).

        Every piece of every stream passes here: a draining node's streams end here, by name (``start_draining``).
        """
        if self._cut:
            raise PeerUnavailable(self._cut)
        if self._upload_limit is not None:
            await self._upload_limit.acquire(min(length, self._upload_limit.max_rate))
        if self._cut:
            raise PeerUnavailable(self._cut)

    async def fetch(self, request: fabric_pb2.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncGenerator[bytes, None]:
        """Fetch over gRPC: the pieces of ``pieces`` as encoded Chunk messages, picks and holdings as metadata."""
        holder = fetch_metadata.holder_of(context.invocation_metadata(), context.peer())
        async with aclosing(self.pieces(request, holder)) as pieces:
            async for piece in pieces:
                if isinstance(piece, FilePiece):
                    yield wire.encode_chunk(piece.offset, await self.context.io(os.pread, piece.file.fileno(), piece.length, piece.offset))
                elif isinstance(piece, BytesPiece):
                    yield wire.encode_chunk(piece.offset, piece.data)
                elif isinstance(piece, Picked):
                    await context.send_initial_metadata(fetch_metadata.picked(piece.chunks, piece.others))
                else:
                    held = fetch_metadata.complete() if piece.complete else fetch_metadata.verified(piece.bitmap or b"")
                    context.set_trailing_metadata((*held, *self.announce))  # and where its data channel is, for the next stream

    async def announce_to(self, context: grpc.aio.ServicerContext) -> None:
        """Tell a GetManifest or Availability caller where this node's data channel is (nothing when it has none)."""
        if self.announce:
            await context.send_initial_metadata(self.announce)

    async def pieces(self, request: fabric_pb2.FetchRequest, holder: tuple[str, int, bytes] | None) -> AsyncGenerator[Piece, None]:
        """What a Fetch of ``request`` sends: chunks of a committed adapter (re-verified on read), or the verified ones of an
        adapter still arriving here; ``holder`` is what the caller said it holds (``fetch_metadata.holder_of``). It is sent
        in one of the node's upload slots: a swarm request's pick is made once it has one."""
        if holder is not None and request.digest:
            self.puller.hint(request.digest, *holder)  # the caller pulls it too: news for our own pull of it
        async with self._slots.slot(), aclosing(self._pieces(request, holder)) as pieces:
            async for piece in pieces:
                yield piece

    async def _pieces(self, request: fabric_pb2.FetchRequest, holder: tuple[str, int, bytes] | None) -> AsyncGenerator[Piece, None]:
        partial = self.store.partial_for(request.digest) if request.digest and self.store.by_digest(request.digest) is None else None
        if partial is not None:
            async with aclosing(self._partial_pieces(partial, request)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        manifest = self._manifest_for(request.adapter_id, request.digest)
        self.signed.check_stored(manifest)  # a node that trusts signers serves only signed adapters
        entry = manifest.file(request.file) if request.file else manifest.weights
        if request.offset % entry.chunk_size:
            raise InvalidArgument(f"Fetch offset {request.offset} is not a multiple of the chunk size {entry.chunk_size}")
        if request.offset > entry.size:
            raise InvalidArgument(f"Fetch offset {request.offset} is past the end of {entry.name} ({entry.size} bytes)")
        end = entry.size if request.length == 0 else min(entry.size, request.offset + request.length)
        chunks: Sequence[int] = range(request.offset // entry.chunk_size, -(-end // entry.chunk_size))
        if request.accept_bitmap and entry.name == manifest.weights.name:
            self.store.touch(manifest.adapter_id)
            with self.context.in_use.hold(manifest.digest):
                async with aclosing(self._seed(manifest, chunks, request, holder)) as pieces:  # its counts are settled in its finally
                    async for piece in pieces:
                        yield piece
            return
        self.store.touch(manifest.adapter_id)  # served to a peer: recently used (an evicting store keeps it longer)
        with self.context.in_use.hold(manifest.digest):  # never evicted while it is being served
            path = await self.context.io(self.store.verified_blob, manifest, entry)  # bytes at rest are re-verified before they leave
            with _open_blob(path, manifest) as f:
                for index in chunks:
                    offset, length = entry.chunk_span(index)
                    await self._throttle(length)
                    SERVED_BYTES.inc(length)
                    yield FilePiece(offset, length, f)
        yield Holds(complete=True)

    async def _seed(
        self, manifest: Manifest, requested: Sequence[int], request: fabric_pb2.FetchRequest, holder: tuple[str, int, bytes] | None,
    ) -> AsyncGenerator[Piece, None]:
        """A swarm request to a node holding the whole adapter: super-seeding.

        It gets the acceptable chunks handed out least. While first copies
        are still on their way to other nodes and this caller takes only
        chunks handed out already, it is told to ask again (busy): the seed's
        upload carries every chunk once before it carries any twice, and the
        caller gets the rest from the nodes that received them. Its pick says how many other pullers asked lately.
        """
        weights, digest = manifest.weights, manifest.digest
        others = self._pullers.others(digest, holder[:2] if holder is not None else None)
        accept = swarm.bitmap_to_chunks(request.accept_bitmap, weights.chunk_count) | set(requested)
        sent = self._sent_counts(digest, weights.chunk_count)
        first_inflight = self._first_inflight.setdefault(digest, set())
        if first_inflight and all(sent[c] for c in accept):
            raise QuotaExceeded(
                f"every chunk of {digest} the caller takes has left this node already and {len(first_inflight)} first copies are on their way: "
                f"fetch from the nodes that received them, or ask again shortly", FIRST_COPIES_BOUND,
            )
        fresh = {c for c in accept if sent[c] == 0}
        chunks = swarm.pick_chunks(requested, accept, lambda c: True, sent, self._rng)
        firsts = [c for c in chunks if c in fresh]
        first_inflight.update(firsts)
        served: set[int] = set()
        try:
            yield Picked(chunks, others)
            with _open_blob(await self.context.io(self.store.verified_weights, manifest), manifest) as f:
                for index in chunks:
                    offset, length = weights.chunk_span(index)
                    await self._throttle(length)
                    SERVED_BYTES.inc(length)
                    served.add(index)  # handed to the channel: a caller that cuts the stream after it may hold it already
                    yield FilePiece(offset, length, f)
            yield Holds(complete=True)
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
        """Super-seeding (adapter_fabric.transport.swarm.pick_chunks): the chunks this node has handed out least, among those the caller takes."""
        sent = self._sent_counts(digest, chunk_count)
        return swarm.pick_chunks(requested, swarm.bitmap_to_chunks(accept_bitmap, chunk_count), holds, sent, self._rng)

    async def _partial_pieces(self, partial, request: fabric_pb2.FetchRequest) -> AsyncGenerator[Piece, None]:
        """Chunks of an adapter still arriving here: only verified ones, and the whole range must be verified up front."""
        self.signed.check_stored(partial.manifest)
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
            yield Picked(list(chunks))
        try:
            try:  # on the loop (an open and an fstat) unless a write holds the partial's lock: a thread hop per request cost 8%
                opened = partial.open_unchanged(wait=False)  # of a swarm node's Python time (issue 34); the committed blob's open is on the loop too
            except (BlockingIOError, FileNotFoundError):  # a write holds it (wait on a thread), or the store went (io names it)
                opened = await self.context.io(partial.open_unchanged)  # verified on arrival, and the file unchanged since
        except InvalidArgument as exc:  # the partial was closed under us (its pull failed)
            raise AdapterNotFound(f"{request.digest} is no longer served here: {exc}") from None
        if opened is not None:
            with opened as f:
                for index in chunks:
                    offset, length = weights.chunk_span(index)
                    await self._throttle(length)
                    SERVED_BYTES.inc(length)
                    PARTIAL_CHUNKS_SERVED.labels("sendfile").inc()
                    yield FilePiece(offset, length, f)
        else:  # the file changed on disk since it was verified, or the download committed meanwhile (read from its blob)
            how = "committed" if partial.committed else "reverified"
            for index in chunks:
                await self._throttle(weights.chunk_span(index)[1])
                try:
                    data = await self.context.io(partial.read_chunk, index)  # re-verified on read
                except InvalidArgument as exc:  # the partial was closed under us (its pull failed)
                    raise AdapterNotFound(f"chunk {index} of {request.digest} is no longer served here: {exc}") from None
                SERVED_BYTES.inc(len(data))
                PARTIAL_CHUNKS_SERVED.labels(how).inc()
                yield BytesPiece(index * weights.chunk_size, data)
        # What it holds by now, so a swarm puller need not poll Availability (adapter_fabric.transport.swarm_pull).
        yield Holds(complete=True) if partial.committed else Holds(complete=False, bitmap=partial.verified_bitmap)

    def availability(self, request: fabric_pb2.AvailabilityRequest) -> fabric_pb2.AvailabilityResponse:
        """Which chunks of a digest this node holds: all of a committed adapter, the verified ones of a partial.

        Every reply says whether this node is durable; one for no digest says only that.
        """
        if not request.digest:
            return fabric_pb2.AvailabilityResponse(durable=self.durable, streams=self.streams_open())
        manifest = self.store.by_digest(request.digest)
        if manifest is not None:
            count = manifest.weights.chunk_count
            return fabric_pb2.AvailabilityResponse(
                complete=True, chunk_count=count, verified_bitmap=swarm.chunks_to_bitmap(range(count), count), durable=self.durable,
                streams=self.streams_open(),
            )
        partial = self.store.partial_for(request.digest)
        if partial is None:
            raise AdapterNotFound(f"no adapter with digest {request.digest} is staged or arriving here")
        return fabric_pb2.AvailabilityResponse(
            complete=False, chunk_count=partial.manifest.weights.chunk_count, verified_bitmap=partial.verified_bitmap, durable=self.durable,
            streams=self.streams_open(),
        )

    def holder_announced(self, request: fabric_pb2.AnnounceRequest) -> fabric_pb2.AnnounceResponse:
        """A holder of one of this node's ids says so (``node.homes``); a node without placement takes no announcement."""
        if self.homes is None:
            raise InvalidArgument("this node keeps no holders (started with --homes 0): announce to the id's homes")
        return self.homes.told(request)
