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

from fabric.format.adapter_tensors import lora_pairs
from fabric.transport.discovery import PeerSource
from fabric.errors import AdapterNotFound, AdaptersUnsupported, Busy, FabricError, IntegrityError, InvalidArgument
from fabric.store.ids import validate_adapter_id, validate_name
from fabric.store.manifest import Manifest
from fabric.serving.generation import Generation
from fabric.serving.pool import ACTIVE
from fabric.format.peft_fields import check_agrees, peft_fields_of
from fabric.rpc.status import rpc_errors
from fabric.store import AdapterStore
from fabric.store.upload import Upload
from fabric.transport.pull import PeerPuller, PullStats
from fabric.v1 import fabric_pb2, fabric_pb2_grpc
from fabric.trust.signing import TrustedSigners
from node.peer_reads import PeerReads
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


class FabricServicer(PeerReads, SignedAdapters, StoreStatusRpc, fabric_pb2_grpc.FabricServicer):
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
                await self._io(upload.close)
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
                    self.store.open_upload, begin.adapter_id, begin.config_json, begin.safetensors_size, begin.safetensors_sha256
                )
            except Busy:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    @rpc_errors
    async def UploadOffset(self, request, context) -> fabric_pb2.UploadOffsetResponse:
        offset = await self._io(self.store.upload_offset, request.adapter_id, request.safetensors_sha256)
        return fabric_pb2.UploadOffsetResponse(offset=offset)

    @rpc_errors
    async def Unstage(self, request, context) -> fabric_pb2.UnstageResponse:
        removed = await self._io(self.store.unstage, validate_adapter_id(request.adapter_id))
        return fabric_pb2.UnstageResponse(bytes_removed=removed)

    # ------------------------------------------------------------ serving peers

    @rpc_errors
    async def GetManifest(self, request, context) -> fabric_pb2.Manifest:
        manifest = await self._io(self.store.get, validate_adapter_id(request.adapter_id))
        self._check_stored(manifest)  # a node that trusts signers serves only signed adapters
        reply = manifest.to_proto()
        reply.signature = await self._io(self.store.signature, manifest.digest)
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
                manifest, _ = await self._io(self.puller.manifest, peers, request.adapter_id)
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

    @rpc_errors
    async def Promote(self, request: fabric_pb2.PromoteRequest, context) -> fabric_pb2.PromoteResponse:
        if request.stage_only:
            return await self._pull_only(request)
        model = self._require_model("promote adapters")
        adapter_id = validate_adapter_id(request.adapter_id)
        name = validate_name(request.name or adapter_id)  # before any byte moves
        requested = request.peft if request.HasField("peft") else None

        def check(manifest: Manifest) -> None:
            # Before any byte moves: the caller's PEFT fields, then this model and pool.
            check_agrees(requested, manifest.config, adapter_id)
            model.check_compatible(lora_pairs(manifest.index, manifest.config))

        manifest, stats, blob = await self._verified(request, adapter_id, check)
        # Map the verified blob and stage it off the model worker (prepare_verified does not hash it again).
        prepared = await self._io(model.prepare_verified, manifest, blob, name)
        try:
            # The memory copy, at the quiescent point; a pin past the limit is refused before anything is evicted.
            slot, evicted = await self._on_model(model.commit, prepared, pin=request.pin)
        finally:
            model.recycle(prepared)
        resident = {info["name"] for info in model.slots_info()}
        self._slot_digests = {k: v for k, v in self._slot_digests.items() if k[0] in resident and k[0] != name}
        self._slot_digests[(name, prepared.content_id)] = manifest.digest
        log.info("promoted %s as %r into slot %d (evicted %r, %d bytes moved)", adapter_id, name, slot, evicted, stats.bytes_transferred)
        return fabric_pb2.PromoteResponse(
            slot=slot,
            evicted_name=evicted or "",
            content_id=model.adapter_id_for(slot),
            digest=manifest.digest,
            bytes_transferred=stats.bytes_transferred,
            source_peer=",".join(stats.source_peers),
            pull_seconds=stats.pull_seconds,
        )

    async def _verified(self, request: fabric_pb2.PromoteRequest, adapter_id: str, check: Callable[[Manifest], None]):
        """``(manifest, stats, weights path)``: the adapter pulled (or found here), its bytes verified since last written.

        Bytes that fail (or a damaged manifest) are quarantined by the store and pulled again from the
        named peer or the known ones, when there are any (fabric.store.integrity).
        """
        stats = PullStats()
        try:
            if request.peer:
                manifest, stats = await self._signed_pull(await self._pull_peers(request), adapter_id, check)
            else:
                manifest = await self._io(self.store.get, adapter_id)
                self._check_stored(manifest)
                check(manifest)
            return manifest, stats, await self._io(self.store.verified_weights, manifest)
        except IntegrityError as exc:
            peers = await self._pull_peers(request) if request.peer else await self._known_peers()
            if not peers:
                raise
            log.warning("%s; pulling it again from %s", exc, ",".join(peers))
            manifest, stats = await self._signed_pull(peers, adapter_id, check)
            return manifest, stats, await self._io(self.store.verified_weights, manifest)

    async def _signed_pull(self, peers: list[str], adapter_id: str, check) -> tuple[Manifest, PullStats]:
        """A pull whose signature is checked (when this node trusts signers) and kept, before any chunk moves."""
        signed_check, digest = await self._io(self._signed_pull_check, peers, adapter_id, check)
        committed = False
        try:
            manifest, stats = await self._io(self.puller.pull, peers, adapter_id, signed_check)
            committed = manifest.digest == digest
            return manifest, stats
        finally:
            await self._io(self._keep_pulled_signature, digest, committed)

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
                self.puller.pull(peers, adapter_id)
            except FabricError as exc:
                log.warning("scrub: could not pull %s again: %s", adapter_id, exc)

    async def _pull_peers(self, request: fabric_pb2.PromoteRequest) -> list[str]:
        """The named peer first, then every known one (unless the caller asked for the named one alone)."""
        _check_peer_address(request.peer)
        if request.named_peer_only:
            return [request.peer]
        return [request.peer, *await self._known_peers()]

    async def _pull_only(self, request: fabric_pb2.PromoteRequest) -> fabric_pb2.PromoteResponse:
        """Promote with stage_only: bring the bytes into the store (and serve them on), load no slot."""
        adapter_id = validate_adapter_id(request.adapter_id)
        requested = request.peft if request.HasField("peft") else None
        stats = PullStats()
        if request.peer:
            manifest, stats = await self._signed_pull(await self._pull_peers(request), adapter_id, lambda m: check_agrees(requested, m.config, adapter_id))
        else:
            manifest = await self._io(self.store.get, adapter_id)
            self._check_stored(manifest)
            check_agrees(requested, manifest.config, adapter_id)
        await self._io(self.store.verified_weights, manifest)
        log.info("pulled %s (stage only, %d bytes moved from %s)", adapter_id, stats.bytes_transferred, ",".join(stats.source_peers) or "-")
        return fabric_pb2.PromoteResponse(
            slot=-1,
            content_id=manifest.content_id,
            digest=manifest.digest,
            bytes_transferred=stats.bytes_transferred,
            source_peer=",".join(stats.source_peers),
            pull_seconds=stats.pull_seconds,
        )

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
                    break  # the caller already has DEADLINE_EXCEEDED
                await self._on_model(run.step)
            return fabric_pb2.GenerateResponse(slot=run.resolved, content_id=run.content_id, last_logits=run.last_logits, output_ids=run.output_ids)
        finally:
            # After any job still queued or running: the ref is dropped, never before it was taken.
            self._model_worker.submit(run.finish)


def _check_peer_address(address: str) -> None:
    """A peer is ``host:port`` over TCP: a ``unix:`` path or any other scheme would reach into this machine."""
    host, _, port = address.rpartition(":")
    if not host or "/" in address or not port.isdigit() or not 0 < int(port) < 65536 or host.lower().startswith(("unix", "vsock")):
        raise InvalidArgument(f"peer address {address[:100]!r} is not host:port (a TCP peer; unix sockets and other schemes are refused)")
