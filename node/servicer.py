"""The fabric.v1 servicer: translates RPCs into library calls.

Threads, and what may block them:
- the event loop: never blocks; it only moves messages;
- the default thread pool: store I/O, hashing and peer pulls;
- one model worker thread: swaps at the quiescent point and forwards. It
  never waits on the network or the disk (DESIGN invariant 7), so while a
  pull runs, Generate keeps answering with the resident adapters.
Library errors become status codes in one place: ``fabric.rpc.status.rpc_errors``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import AsyncIterator, Callable, Sequence, TypeVar

from aiolimiter import AsyncLimiter

from fabric.transport.discovery import PeerSource
from fabric.errors import AdapterNotFound, AdaptersUnsupported, Busy, DeadlineExceeded, FabricError, IntegrityError, InvalidArgument
from fabric.store.digests import DIGEST_SCHEME, check_scheme
from fabric.store.ids import validate_adapter_id
from fabric.store.manifest import Manifest
from fabric.serving.generation import Generation
from fabric.serving.pool import ACTIVE
from fabric.format.peft_fields import peft_fields_of
from fabric.rpc.status import rpc_errors
from fabric.store import AdapterStore
from fabric.store.upload import Upload
from fabric.transport.pull import PeerPuller
from fabric.v1 import fabric_pb2, fabric_pb2_grpc
from fabric.trust.signing import TrustedSigners
from node.peer_reads import PeerReads
from node.promotes import Promotes
from node.signed import SignedAdapters
from node.store_status import StoreStatusRpc

log = logging.getLogger("fabric.node")
T = TypeVar("T")

#: the name a GenerateRequest uses for the base model
BASE_NAME = "base"
#: --max-new-tokens' default: one request's decode steps, each a forward on the model worker
DEFAULT_MAX_NEW_TOKENS = 256
#: seconds between two scrubs of the whole store (the first runs at start)
SCRUB_INTERVAL_S = 6 * 3600.0
#: How long a Stage waits for an earlier stream of the same upload to let go before refusing it as Busy.
UPLOAD_RELEASE_WAIT_S = 3.0


class FabricServicer(Promotes, PeerReads, SignedAdapters, StoreStatusRpc, fabric_pb2_grpc.FabricServicer):
    def __init__(
        self, store: AdapterStore, model, puller: PeerPuller, peers: Sequence[str] = (), upload_rate: int = 0, peer_source: PeerSource | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, scrub_rate: int = 0, trusted: TrustedSigners | None = None,
    ) -> None:
        self.store = store
        #: the signers whose adapters alone this node stages, pulls, loads and serves (none = any adapter)
        self.trusted = trusted or TrustedSigners()
        self._pulling_signatures: dict[str, bytes] = {}  # digest -> signature, while its pull runs (node.signed)
        #: the most tokens one Generate may ask for (--max-new-tokens)
        self.max_new_tokens = max_new_tokens
        # One bucket for all streams: the flag bounds what the node serves in total.
        self._upload_limit = AsyncLimiter(upload_rate, 1.0) if upload_rate > 0 else None
        self.model = model
        self.puller = puller
        self.peers = tuple(peers)
        # Known peers: the static list plus a DNS name, re-resolved on every use (fabric.transport.discovery).
        self.peer_source = peer_source or PeerSource(static=self.peers)
        self._model_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # Per digest, how often each chunk was handed out to swarm pulls (super-seeding); touched on the event loop only.
        self._sent: dict[str, list[int]] = {}
        self._rng = random.Random()
        self._first_inflight: dict[str, set[int]] = {}  # per digest: chunks whose first copy is being sent
        self._scrub_stop = threading.Event()
        self._slot_digests: dict[tuple[str, int], str] = {}  # (name, content id) of a promote -> the digest it loaded
        if scrub_rate > 0:
            threading.Thread(target=self._scrub_loop, args=(scrub_rate,), name="scrub", daemon=True).start()

    def close(self) -> None:
        self._scrub_stop.set()
        self._model_worker.shutdown(wait=True)
        self.puller.channels.close()

    # ------------------------------------------------------------ helpers

    async def _io(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _io_cleanup(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``_io`` for clean-up that must happen: a cancel of the caller's RPC (a client cut its stream) meanwhile
        would otherwise withdraw the job before a thread took it, leaving, say, an upload held for good."""
        return await asyncio.shield(self._io(fn, *args, **kwargs))

    async def _on_model(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._model_worker, partial(fn, *args, **kwargs))

    def _require_model(self, what: str):
        if self.model is None:
            raise AdaptersUnsupported(f"this node is store-only (started with --model none): it cannot {what}; use a node with a model")
        return self.model

    async def _known_peers(self) -> list[str]:
        return await self._io(self.peer_source.peers)

    def _manifest_for(self, adapter_id: str, digest: str) -> Manifest:
        if digest:
            manifest = self.store.by_digest(digest)
            if manifest is None:
                raise AdapterNotFound(f"no adapter with digest {digest} is staged here")
            return manifest
        return self.store.get(validate_adapter_id(adapter_id))

    # ------------------------------------------------------------ staging

    @rpc_errors
    async def Stage(self, request_iterator: AsyncIterator[fabric_pb2.StageRequest], context) -> fabric_pb2.StageResponse:
        upload = None
        received = 0
        signed_digest = ""
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "begin":
                    if upload is not None:
                        raise InvalidArgument("Stage stream sent a second StageBegin; send it once, first")
                    begin = message.begin
                    signed_digest = self._check_stage_begin(begin)  # before any byte moves
                    upload = await self._open_upload(begin)
                    if begin.offset != upload.offset:
                        await self._io(upload.rewind, begin.offset)  # refuses an offset beyond what is held
                elif kind == "data":
                    if upload is None:
                        raise InvalidArgument("Stage stream sent data before its StageBegin")
                    await self._io(upload.append, message.data.offset, message.data.data)
                    received += len(message.data.data)
                else:
                    raise InvalidArgument("Stage stream sent an empty StageRequest")
            if upload is None:
                raise InvalidArgument("Stage stream ended without a StageBegin")
            # A stream that ends early leaves its verified prefix in the upload area for a resume.
            manifest = await self._io(upload.commit)
            if manifest.digest == signed_digest:  # the signature travels with the manifest from here
                await self._io(self.store.set_signature, manifest.digest, begin.signature)
        except BaseException:
            if upload is not None:
                # Free the upload's lock and descriptor now; its verified prefix stays on disk for a resume.
                await self._io_cleanup(upload.close)
            raise
        log.info("staged %s digest=%s (%d bytes received)", manifest.adapter_id, manifest.digest[:12], received)
        return fabric_pb2.StageResponse(
            adapter_id=manifest.adapter_id,
            digest=manifest.digest,
            content_id=manifest.content_id,
            bytes_received=received,
            already_staged=upload.already_staged,
        )

    async def _open_upload(self, begin: fabric_pb2.StageBegin) -> Upload:
        """Open ``begin``'s upload, waiting a little for an earlier stream of it to let go: a client that crashed
        mid-upload and resumes at once meets its own dead stream still winding down here. Waits off the I/O threads."""
        deadline = time.monotonic() + UPLOAD_RELEASE_WAIT_S
        while True:
            try:
                return await self._io(
                    self.store.open_upload, begin.adapter_id, begin.config_json, begin.safetensors_size, begin.safetensors_blake3, begin.weights_root
                )
            except Busy:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    @rpc_errors
    async def UploadOffset(self, request, context) -> fabric_pb2.UploadOffsetResponse:
        if not request.safetensors_blake3:  # what a scheme-1 client sends (its safetensors_sha256 is reserved now)
            check_scheme(fabric_pb2.DIGEST_SCHEME_UNSPECIFIED, f"UploadOffset of {request.adapter_id[:200]!r}, naming no safetensors_blake3,")
        offset = await self._io(self.store.upload_offset, request.adapter_id, request.safetensors_blake3)
        return fabric_pb2.UploadOffsetResponse(offset=offset, chunk_size=self.store.chunk_size, digest_scheme=DIGEST_SCHEME)

    @rpc_errors
    async def Unstage(self, request, context) -> fabric_pb2.UnstageResponse:
        removed = await self._io(self.store.unstage, validate_adapter_id(request.adapter_id))
        return fabric_pb2.UnstageResponse(bytes_removed=removed)

    # ------------------------------------------------------------ serving peers

    @rpc_errors
    async def GetManifest(self, request, context) -> fabric_pb2.Manifest:
        # A caller of another digest scheme would misread every digest of the answer: refused by name instead.
        check_scheme(request.digest_scheme, f"GetManifest of {request.adapter_id[:200]!r} from a caller that")
        manifest = await self._io(self.store.get, validate_adapter_id(request.adapter_id))
        self._check_stored(manifest)  # a node that trusts signers serves only signed adapters
        reply = manifest.to_proto()
        reply.signature = await self._io(self.store.signature, manifest.digest)
        if request.with_sha256:
            for name, sha256 in (await self._io(self.store.file_sha256, manifest)).items():
                reply.file_sha256[name] = sha256
        return reply

    @rpc_errors
    async def Locate(self, request, context) -> fabric_pb2.LocateResponse:
        """Which known peers hold the adapter, fully or in part (this node itself is not listed)."""
        peers = await self._known_peers()
        digest = request.digest
        if not digest:
            try:
                digest = self.store.get(validate_adapter_id(request.adapter_id)).digest
            except AdapterNotFound:
                manifest, _, _ = await self._io(self.puller.manifest, peers, request.adapter_id)
                digest = manifest.digest
        holdings = await asyncio.gather(*(self._io(self.puller.availability, peer, digest) for peer in peers))
        return fabric_pb2.LocateResponse(digest=digest, peers=[h for h in holdings if h is not None])

    # ------------------------------------------------------------ slots

    @rpc_errors
    async def ListAdapters(self, request, context) -> fabric_pb2.ListAdaptersResponse:
        # A damaged entry is listed with its problem (fabric.store.integrity), never failing the whole list.
        damaged = {d.adapter_id: d for d in await self._io(self.store.damaged)}
        staged = [
            fabric_pb2.StagedAdapter(
                adapter_id=m.adapter_id, digest=m.digest, content_id=m.content_id, size=sum(f.size for f in m.files), peft=peft_fields_of(m.config),
                damaged=damaged.pop(m.adapter_id).problem if m.adapter_id in damaged else "",
            )
            for m in await self._io(self.store.list)
        ]
        staged += [fabric_pb2.StagedAdapter(adapter_id=d.adapter_id, digest=d.digest, damaged=d.problem) for d in damaged.values()]
        staged.sort(key=lambda a: a.adapter_id)
        reply = fabric_pb2.ListAdaptersResponse(staged=staged)
        if self.model is not None:
            reply.max_rank = self.model.pool.max_rank
            reply.device = str(self.model.device)
            for info in self.model.slots_info():
                reply.slots.append(
                    fabric_pb2.SlotInfo(
                        slot=info["slot"],
                        name=info["name"] or "",
                        content_id=info["content_id"],
                        ref_count=info["ref_count"],
                        pinned=info["pinned"],
                        active=info["active"],
                        last_used=info["last_used"],
                        rank=info["rank"],
                        # The bytes it holds, also once they are unstaged from the store.
                        digest=self._slot_digests.get((info["name"], info["content_id"]), ""),
                    )
                )
        return reply

    def _scrub_loop(self, rate: int) -> None:
        """Re-read every committed blob now and then every SCRUB_INTERVAL_S, at ``rate`` bytes/s; re-pull what fails."""
        while not self._scrub_stop.is_set():
            try:
                self.store.scrub(rate, self._scrub_stop, self._repair)
            except Exception:  # noqa: BLE001 - a scrub must never take the node down; it runs again later
                log.exception("store scrub failed")
            self._scrub_stop.wait(SCRUB_INTERVAL_S)

    def _repair(self, adapter_id: str, error: IntegrityError) -> None:
        peers = self.peer_source.peers()
        log.warning("scrub: %s; %s", error, f"pulling it again from {','.join(peers)}" if peers else "no peer to pull it from")
        if peers:
            try:
                self._pull_signed(peers, adapter_id)  # the trust check of any pull: a peer may hold other bytes under this id by now
            except FabricError as exc:
                log.warning("scrub: could not pull %s again: %s", adapter_id, exc)

    @rpc_errors
    async def SetActive(self, request, context) -> fabric_pb2.SetActiveResponse:
        model = self._require_model("set an active adapter")
        await self._on_model(model.set_active_lora, request.name)
        slot = model.pool.active_slot
        return fabric_pb2.SetActiveResponse(slot=slot, content_id=model.adapter_id_for(slot))

    @rpc_errors
    async def Pin(self, request, context) -> fabric_pb2.PinResponse:
        model = self._require_model("pin adapters")
        await self._on_model(model.pin, request.name, request.pinned)
        return fabric_pb2.PinResponse(slot=model.pool.slot_of(request.name))

    @rpc_errors
    async def Generate(self, request: fabric_pb2.GenerateRequest, context) -> fabric_pb2.GenerateResponse:
        model = self._require_model("generate")
        # None = base model, -1 = the active adapter (base when none is active), else a resident name.
        target = None if request.use_base or request.adapter == BASE_NAME else (request.adapter or ACTIVE)
        run = Generation(model, request.input_ids, target, request.max_new_tokens, request.return_logits, self.max_new_tokens)
        try:
            # One job per step (fabric.serving.generation): promotes land between steps, and a caller
            # that cancels or passes its deadline (this coroutine is cancelled) stops the steps.
            await self._on_model(run.start)
            while not run.done:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    # Never an OK with fewer tokens than asked: the server's clock may pass the deadline
                    # a moment before the caller's, which would then take a cut generation for a whole one.
                    raise DeadlineExceeded(
                        f"the deadline passed after {len(run.output_ids)} of {request.max_new_tokens} new tokens; ask for fewer, or allow more time"
                    )
                await self._on_model(run.step)
            return fabric_pb2.GenerateResponse(slot=run.resolved, content_id=run.content_id, last_logits=run.last_logits, output_ids=run.output_ids)
        finally:
            # After any job still queued or running: the ref is dropped, never before it was taken.
            self._model_worker.submit(run.finish)
