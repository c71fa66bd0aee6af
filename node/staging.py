"""Staging RPCs: Stage (a client's upload, resumable), UploadOffset, and Unstage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import NamedTuple

from adapter_fabric.access.caller import caller
from adapter_fabric.access.policy import Principal
from adapter_fabric.errors import Busy, InvalidArgument
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.observability.logs import event
from adapter_fabric.store.digests import DIGEST_SCHEME, check_scheme
from adapter_fabric.store.ids import validate_adapter_id
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.store.quota import MakeRoom, opened_with_room
from adapter_fabric.store.upload import Upload
from adapter_fabric.trust.signing import Signed
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.node")


class Accepted(NamedTuple):
    """A StageBegin accepted: the digest its files will have, its signature to keep once they commit, the id's digest before."""

    digest: str
    signed: Signed | None
    prior: str | None

#: How long a Stage waits for an earlier stream of the same upload to let go before refusing it as Busy.
UPLOAD_RELEASE_WAIT_S = 3.0


class Staging:
    """Stage, UploadOffset and Unstage: adapters entering and leaving this node's store from a client."""

    def __init__(
        self, context: NodeContext, signed: SignedAdapters, make_room: MakeRoom | None = None, on_staged: Callable[[str, str], None] | None = None
    ) -> None:
        """``on_staged(adapter_id, digest)``: after each commit (the node's homes pull it: ``node.homes.Homes.published``)."""
        self.on_staged = on_staged
        """``make_room``: asked, off the store's locks, when the store refuses an upload for room (the node's evictor)."""
        self.context = context
        self.store = context.store
        self.signed = signed
        self.make_room = make_room

    async def stage(self, request_iterator: AsyncIterator[fabric_pb2.StageRequest]) -> fabric_pb2.StageResponse:
        """Receive one upload: a StageBegin first, then data; commit it when the stream ends."""
        io = self.context.io
        who = caller()  # the principal the gate admitted: its signer places, what it may learn of held bytes
        upload = None
        received = 0
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "begin":
                    if upload is not None:
                        raise InvalidArgument("Stage stream sent a second StageBegin; send it once, first")
                    begin = message.begin
                    accepted = await io(self.accept, begin, who)  # before any byte moves
                    upload, waited = await self._open_upload(begin)
                    if begin.offset > upload.offset and (waited or not upload.offset):
                        # What the client resumes from is gone: the stream it waited for (or one before) committed
                        # or dropped the upload meanwhile. Busy, not a bad offset: asking UploadOffset again resolves it.
                        raise Busy(
                            f"Stage of {begin.adapter_id!r} resumes at offset {begin.offset} but this node holds {upload.offset} bytes of it: "
                            f"another Stage stream of the same bytes committed or dropped them meanwhile; ask UploadOffset and resume from there"
                        )
                    if begin.offset != upload.offset:
                        await io(upload.rewind, begin.offset)  # refuses an offset beyond what is held
                elif kind == "data":
                    if upload is None:
                        raise InvalidArgument("Stage stream sent data before its StageBegin")
                    await io(upload.append, message.data.offset, message.data.data)
                    received += len(message.data.data)
                else:
                    raise InvalidArgument("Stage stream sent an empty StageRequest")
            if upload is None:
                raise InvalidArgument("Stage stream ended without a StageBegin")
            # A stream that ends early leaves its verified prefix in the upload area for a resume.
            manifest = await io(upload.commit)
            reply = await io(self.staged, upload, manifest, accepted, who, received)
        except BaseException:
            if upload is not None:
                # Free the upload's lock and descriptor now; its verified prefix stays on disk for a resume
                # (an upload holding nothing leaves no directory behind).
                await self.context.io_cleanup(upload.close if upload.offset else upload.discard)
            raise
        log.info("staged %s digest=%s (%d bytes received)", manifest.adapter_id, manifest.digest[:12], received)
        if self.on_staged is not None:
            self.on_staged(manifest.adapter_id, manifest.digest)  # queues background work only
        return reply

    def accept(self, begin: fabric_pb2.StageBegin, who: Principal) -> Accepted:
        """A StageBegin's checks before any byte moves (scheme, digests, signature: ``SignedAdapters.check_stage_begin``), and
        the digest its id referred to before. Blocking."""
        signed_digest, signed = self.signed.check_stage_begin(begin, who)
        return Accepted(signed_digest, signed, self.store.digest_of(validate_adapter_id(begin.adapter_id)))

    def staged(self, upload: Upload, manifest: Manifest, accepted: Accepted, who: Principal, received: int) -> fabric_pb2.StageResponse:
        """What follows a committed upload: its signature kept, and the reply (``already_staged`` only where ``who`` may
        know it). Blocking."""
        if accepted.signed is not None and manifest.digest == accepted.digest:  # the signature travels with the manifest from here
            self.signed.keep_staged(manifest.digest, accepted.signed, manifest.adapter_id, who)
        return fabric_pb2.StageResponse(
            adapter_id=manifest.adapter_id,
            digest=manifest.digest,
            content_id=manifest.content_id,
            bytes_received=received,
            already_staged=upload.already_staged and self._may_know_held(who, manifest.adapter_id, manifest.digest, accepted.prior),
        )

    def _may_know_held(self, who: Principal, adapter_id: str, digest: str, prior: str | None) -> bool:
        """Whether ``who`` may learn that ``digest`` was here before its Stage: it held it under this id, or may read another
        id that holds it. Otherwise the bytes were taken as new (deduplicated silently), and ``already_staged`` says false:
        another tenant's holdings are not the caller's to learn."""
        if prior == digest or who.may_everywhere("read"):
            return True
        return any(i != adapter_id and who.allows("read", i) for i in self.store.ids_of(digest))

    async def _open_upload(self, begin: fabric_pb2.StageBegin) -> tuple[Upload, bool]:
        """Open ``begin``'s upload, waiting a little for an earlier stream of it to let go: a client that crashed
        mid-upload and resumes at once meets its own dead stream still winding down here. Waits off the I/O threads.
        The upload, and whether another stream held it first."""
        deadline = time.monotonic() + UPLOAD_RELEASE_WAIT_S
        waited = False
        while True:
            try:
                upload = await self.context.io(self.open, begin)
                return upload, waited
            except Busy:
                if not waited:
                    event(log, "a Stage waits for an earlier stream of its upload to let go", adapter=begin.adapter_id[:200],
                          bound_s=UPLOAD_RELEASE_WAIT_S)
                waited = True
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    def open(self, begin: fabric_pb2.StageBegin) -> Upload:
        """``begin``'s upload, room made for it when the store is full; ``Busy`` while another stream sends the same bytes. Blocking."""
        return opened_with_room(partial(self._open, begin), self.make_room)

    def _open(self, begin: fabric_pb2.StageBegin) -> Upload:
        return self.store.open_upload(begin.adapter_id, begin.config_json, begin.safetensors_size, begin.safetensors_blake3, begin.weights_root)

    async def upload_offset(self, request: fabric_pb2.UploadOffsetRequest) -> fabric_pb2.UploadOffsetResponse:
        """How much of an upload this node holds, for a client's resume."""
        if not request.safetensors_blake3:  # what a scheme-1 client sends (its safetensors_sha256 is reserved now)
            check_scheme(fabric_pb2.DIGEST_SCHEME_UNSPECIFIED, f"UploadOffset of {request.adapter_id[:200]!r}, naming no safetensors_blake3,")
        offset = await self.context.io(self.store.upload_offset, request.adapter_id, request.safetensors_blake3)
        return fabric_pb2.UploadOffsetResponse(offset=offset, chunk_size=self.store.chunk_size, digest_scheme=DIGEST_SCHEME)

    async def unstage(self, request: fabric_pb2.UnstageRequest) -> fabric_pb2.UnstageResponse:
        """Remove a staged adapter from the store (a resident slot keeps its copy)."""
        removed = await self.context.io(self.store.unstage, validate_adapter_id(request.adapter_id))
        return fabric_pb2.UnstageResponse(bytes_removed=removed)

    async def keep(self, request: fabric_pb2.KeepRequest) -> fabric_pb2.KeepResponse:
        """Keep a staged adapter (an evicting store never drops it), or stop keeping it."""
        adapter_id = validate_adapter_id(request.adapter_id)
        await self.context.io(self.store.keep, adapter_id, not request.unkeep)
        return fabric_pb2.KeepResponse(kept=not request.unkeep)
