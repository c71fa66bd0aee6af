"""The fabric.v1 servicer: the service edge, each RPC handed to the group that owns it.

The groups (composed by ``adapter_fabric.node.assembly.build_node``): ``Staging`` (Stage, UploadOffset,
Unstage), ``StageMany``, ``PeerReads`` (GetManifest, Locate, Fetch, Availability, Announce),
``Promotes`` (Promote), ``Slots`` (ListAdapters, SetActive, Pin, Generate)
and ``StoreReport`` (StoreStatus). Library errors become status codes here and nowhere
else: every RPC is wrapped by ``adapter_fabric.rpc.status.rpc_errors``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from adapter_fabric.access.caller import caller
from adapter_fabric.node.peer_reads import PeerReads
from adapter_fabric.node.promotes import Promotes
from adapter_fabric.node.slots import Slots
from adapter_fabric.node.stage_many import StageMany
from adapter_fabric.node.staging import Staging
from adapter_fabric.node.store_status import StoreReport
from adapter_fabric.rpc.status import rpc_errors
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc


class FabricServicer(fabric_pb2_grpc.FabricServicer):
    """Every fabric.v1 RPC, one line each: the group named below does the work; ``rpc_errors`` maps its errors."""

    def __init__(
        self, staging: Staging, stage_many: StageMany, peer_reads: PeerReads, promotes: Promotes, slots: Slots, store_status: StoreReport, *,
        policy: bool = False,
    ) -> None:
        self._staging = staging
        self._stage_many = stage_many
        self._peer_reads = peer_reads
        self._promotes = promotes
        self._slots = slots
        self._store_status = store_status
        self._policy = policy  # whether the node runs with --policy (WhoAmI says so)

    # ------------------------------------------------------------ staging

    @rpc_errors
    async def Stage(self, request_iterator: AsyncIterator[fabric_pb2.StageRequest], context: grpc.aio.ServicerContext) -> fabric_pb2.StageResponse:
        return await self._staging.stage(request_iterator)

    @rpc_errors
    async def StageMany(
        self, request_iterator: AsyncIterator[fabric_pb2.StageManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[fabric_pb2.StageManyResult, None]:
        async with aclosing(self._stage_many.stage_many(request_iterator)) as results:  # type: ignore[type-var]
            async for result in results:
                yield result

    @rpc_errors
    async def UploadOffset(self, request: fabric_pb2.UploadOffsetRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.UploadOffsetResponse:
        return await self._staging.upload_offset(request)

    @rpc_errors
    async def Unstage(self, request: fabric_pb2.UnstageRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.UnstageResponse:
        return await self._staging.unstage(request)

    @rpc_errors
    async def Keep(self, request: fabric_pb2.KeepRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.KeepResponse:
        return await self._staging.keep(request)

    # ------------------------------------------------------------ serving peers

    @rpc_errors
    async def GetManifest(self, request: fabric_pb2.GetManifestRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.Manifest:
        reply = await self._peer_reads.get_manifest(request)
        await self._peer_reads.announce_to(context)  # where this node's data channel is
        return reply

    @rpc_errors
    async def Locate(self, request: fabric_pb2.LocateRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.LocateResponse:
        return await self._peer_reads.locate(request)

    @rpc_errors
    async def Fetch(self, request: fabric_pb2.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncGenerator[bytes, None]:
        # aclosing: a stream cut here closes the group's stream at once (super-seeding's counts are settled in its finally).
        async with aclosing(self._peer_reads.fetch(request, context)) as messages:
            async for message in messages:
                yield message

    @rpc_errors
    async def Availability(self, request: fabric_pb2.AvailabilityRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.AvailabilityResponse:
        reply = self._peer_reads.availability(request)
        await self._peer_reads.announce_to(context)
        return reply

    @rpc_errors
    async def Announce(self, request: fabric_pb2.AnnounceRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.AnnounceResponse:
        return self._peer_reads.holder_announced(request)

    # ------------------------------------------------------------ promotes and slots

    @rpc_errors
    async def Promote(self, request: fabric_pb2.PromoteRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.PromoteResponse:
        return await self._promotes.promote(request)

    @rpc_errors
    async def ListAdapters(self, request: fabric_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.ListAdaptersResponse:
        return await self._slots.list_adapters(request)

    @rpc_errors
    async def SetActive(self, request: fabric_pb2.SetActiveRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.SetActiveResponse:
        return await self._slots.set_active(request)

    @rpc_errors
    async def Pin(self, request: fabric_pb2.PinRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.PinResponse:
        return await self._slots.pin(request)

    @rpc_errors
    async def Generate(self, request: fabric_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.GenerateResponse:
        return await self._slots.generate(request, context)

    # ------------------------------------------------------------ store

    @rpc_errors
    async def StoreStatus(self, request: fabric_pb2.StoreStatusRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.StoreStatusResponse:
        return await self._store_status.report()

    # ------------------------------------------------------------ access

    @rpc_errors
    async def WhoAmI(self, request: fabric_pb2.WhoAmIRequest, context: grpc.aio.ServicerContext) -> fabric_pb2.WhoAmIResponse:
        who = caller()  # set by node.gate; the cluster principal where no policy is set
        grants = [fabric_pb2.AccessGrant(verbs=sorted(g.verbs), prefixes=list(g.prefixes)) for g in who.grants]
        return fabric_pb2.WhoAmIResponse(principal=who.name, grants=grants, policy=self._policy)
