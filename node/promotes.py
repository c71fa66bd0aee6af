"""Promote: pull an adapter (or find it here), verify it, and land it in a slot.

The order is docs/ARCHITECTURE.md's ("Promote from a peer"): the peer's
manifest is checked against the caller's PEFT fields, this model and pool,
and the trusted signers before a byte moves; the slot row is staged while the
verified chunks land (``adapter_fabric.serving.row_sink``); the commit at the
quiescent point is a memory copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from adapter_fabric.access.caller import caller
from adapter_fabric.errors import IncompatibleAdapter, IntegrityError, InvalidArgument
from adapter_fabric.format.base_model import base_model_matches
from adapter_fabric.format.peft_fields import check_agrees
from adapter_fabric.node.authority import pull_authority
from adapter_fabric.node.context import NodeContext
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.origin_fetch import OriginFetches
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.store.ids import validate_adapter_id, validate_name
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport.pull import PullStats, SinkFor
from adapter_fabric.transport.swarm import swarm_peers
from adapter_fabric.v1 import fabric_pb2

log = logging.getLogger("fabric.node")


class Promotes:
    """Promote (into a slot, or ``stage_only`` into the store)."""

    def __init__(
        self, context: NodeContext, signed: SignedAdapters, origins: OriginFetches | None = None, homes: Homes | None = None, model_names: tuple[str, ...] = ()
    ) -> None:
        """``origins``: a request naming no peer: held, else the fleet or the peers, else the --origin list (``node.origin_fetch``);
        ``homes``: this node's part in the fleet (``node.homes``): a pull tells the id's homes this node holds it now."""
        self.homes = homes
        self.context = context
        #: the names the node's model goes by (--model, --base-model): a promote refuses an adapter made for another model
        self.model_names = model_names
        self.store = context.store
        self.signed = signed
        self.origins = origins

    async def promote(self, request: fabric_pb2.PromoteRequest) -> fabric_pb2.PromoteResponse:
        """Bring the adapter here (pulled from the peers, or staged already), verified, then into a slot (or the store only).

        While it runs, the id is in use (an evicting store never drops it); once done, it is the most recently used.
        """
        adapter_id = validate_adapter_id(request.adapter_id)
        with self.context.in_use.hold(adapter_id):
            reply = await (self._pull_only(request) if request.stage_only else self._promote(request))
        await self.context.io(self.store.touch, adapter_id)
        return reply

    async def _promote(self, request: fabric_pb2.PromoteRequest) -> fabric_pb2.PromoteResponse:
        model = self.context.require_model("promote adapters")
        adapter_id = validate_adapter_id(request.adapter_id)
        name = validate_name(request.name or adapter_id)  # before any byte moves
        requested = request.peft if request.HasField("peft") else None

        def check(manifest: Manifest) -> None:
            # Before any byte moves: the caller's PEFT fields, then this model and pool.
            check_agrees(requested, manifest.config, adapter_id)
            self._check_base_model(manifest, adapter_id)
            model.check_compatible(manifest.pairs)

        sinks: list = []

        def sink_for(manifest: Manifest):
            # The slot row is staged as the pull's verified chunks land (adapter_fabric.serving.row_sink).
            sink = model.row_sink(manifest)
            sinks.extend([sink] if sink is not None else [])
            return sink

        try:
            manifest, stats, blob = await self._verified(request, adapter_id, check, sink_for)
            staged = next((s for s in reversed(sinks) if s.digest == manifest.digest and s.complete), None)
            if staged is not None:
                prepared = model.prepared_from(staged, manifest, blob, name)  # the pull staged it: no pass over the bytes
            else:
                # Bytes that were here already (or a shared download): map the verified blob and stage it, off the model worker.
                prepared = await self.context.io(model.prepare_verified, manifest, blob, name)
        finally:
            for sink in sinks:
                sink.abandon()  # a no-op for the one handed over
        try:
            # The memory copy, at the quiescent point; a pin past the limit is refused before anything is evicted.
            slot, evicted = await self.context.on_model(model.commit, prepared, pin=request.pin)
        finally:
            model.recycle(prepared)
        log.info("promoted %s as %r into slot %d (%s, %d bytes moved, %s)", adapter_id, name, slot,
                 f"evicted {evicted!r}" if evicted else "nothing evicted", stats.bytes_transferred,
                 "row staged while receiving" if staged is not None else "row staged from the store")
        return fabric_pb2.PromoteResponse(
            slot=slot,
            evicted_name=evicted or "",
            content_id=model.adapter_id_for(slot),
            digest=manifest.digest,
            bytes_transferred=stats.bytes_transferred,
            source_peer=",".join(stats.source_peers),
            pull_seconds=stats.pull_seconds,
            joined=stats.shared,
            **dict(zip(("origin", "revision"), await self._origin_of(adapter_id, manifest), strict=True)),
        )

    def _check_base_model(self, manifest: Manifest, adapter_id: str) -> None:
        """Refuse an adapter whose base_model_name_or_path names another model (its shapes may fit this one all the same)."""
        base = manifest.config.base_model_name_or_path
        if base and self.model_names and not base_model_matches(base, self.model_names):  # no claim matches any model
            raise IncompatibleAdapter(
                f"adapter {adapter_id!r} is for base model {base[:200]!r}, and this node serves {', '.join(self.model_names)}: promote it on a "
                f"node serving that model, or, if it is this model under another name, start this node with --base-model {base[:200]} "
                "(FABRIC_BASE_MODEL)"
            )

    async def _verified(
        self, request: fabric_pb2.PromoteRequest, adapter_id: str, check: Callable[[Manifest], None], sink_for: SinkFor | None = None
    ) -> tuple[Manifest, PullStats, Path]:
        """``(manifest, stats, weights path)``: the adapter pulled (or found here), its bytes verified since last written.

        ``sink_for``: as ``PeerPuller.pull``'s, for a pull (a slot row staged while receiving).

        Bytes that fail (or a damaged manifest) are quarantined by the store and pulled again from the
        named peer or the known ones, when there are any (adapter_fabric.store.integrity).
        """
        stats = PullStats()
        try:
            if request.peer:
                manifest, stats = await self._signed_pull(await self._pull_peers(request), adapter_id, check, sink_for)
            else:
                manifest, stats = await self._resolved(adapter_id, request)
                check(manifest)
            return manifest, stats, await self.context.io(self.store.verified_weights, manifest)
        except IntegrityError as exc:
            peers = await self._pull_peers(request) if request.peer else await self.context.known_peers()
            if not peers:
                raise
            log.warning("%s; pulling it again from %s", exc, ",".join(peers))
            manifest, stats = await self._signed_pull(peers, adapter_id, check, sink_for)
            return manifest, stats, await self.context.io(self.store.verified_weights, manifest)

    async def _signed_pull(
        self, peers: list[str], adapter_id: str, check: Callable[[Manifest], None], sink_for: SinkFor | None = None
    ) -> tuple[Manifest, PullStats]:
        """A pull whose signature is checked (when this node trusts signers) and kept, before any chunk moves; the id's
        homes are told this node holds it now.

        It runs with the calling principal's authority (``pull_authority``), read here, in the RPC's own context.
        """
        who = caller()
        manifest, stats = await self.context.io(self.signed.pull, peers, adapter_id, check, sink_for, who, **pull_authority(who, self.store))
        if self.homes is not None and stats.referred:
            self.homes.announce(adapter_id, manifest.digest)
        return manifest, stats

    async def _pull_peers(self, request: fabric_pb2.PromoteRequest) -> list[str]:
        """The named peer first, then the known ones, at most ``SWARM_PEERS`` of them (unless the caller asked for the named one alone).

        A named peer that is not a member of this node's cluster is refused before it is dialled (``NotAMember``), unless the
        node has no credential to withhold or pulls from such peers anonymously (``adapter_fabric.transport.membership``).
        """
        _check_peer_address(request.peer)
        members = self.signed.puller.channels.members
        if members is not None:
            members.check_named(request.peer)
        if request.named_peer_only:
            return [request.peer]
        return swarm_peers(request.peer, await self.context.known_peers())  # the named peer may be a known one too

    async def _pull_only(self, request: fabric_pb2.PromoteRequest) -> fabric_pb2.PromoteResponse:
        """Promote with stage_only: bring the bytes into the store (and serve them on), load no slot."""
        adapter_id = validate_adapter_id(request.adapter_id)
        requested = request.peft if request.HasField("peft") else None
        stats = PullStats()
        if request.peer:

            def check(manifest: Manifest) -> None:
                check_agrees(requested, manifest.config, adapter_id)
                _check_base(request, manifest)

            manifest, stats = await self._signed_pull(await self._pull_peers(request), adapter_id, check)
        else:
            manifest, stats = await self._resolved(adapter_id, request)
            check_agrees(requested, manifest.config, adapter_id)
        await self.context.io(self.store.verified_weights, manifest)
        origin, revision = await self._origin_of(adapter_id, manifest)
        export = ""
        if request.export_version:
            exported = await self.context.io(self.store.export_version, adapter_id, manifest)
            export = exported.name if exported is not None else ""
        log.info("pulled %s (stage only, %d bytes moved from %s)", adapter_id, stats.bytes_transferred, ",".join(stats.source_peers) or "-")
        return fabric_pb2.PromoteResponse(
            slot=-1,
            content_id=manifest.content_id,
            digest=manifest.digest,
            bytes_transferred=stats.bytes_transferred,
            source_peer=",".join(stats.source_peers),
            pull_seconds=stats.pull_seconds,
            joined=stats.shared,
            origin=origin,
            revision=revision,
            export_name=export,
        )

    async def _resolved(self, adapter_id: str, request: fabric_pb2.PromoteRequest) -> tuple[Manifest, PullStats]:
        """No peer named: held here (revalidated past --origin-ttl), else from the known peers, else the origins (node.origin_fetch)."""
        if self.origins is None:
            manifest, stats = await self.context.io(self.store.get, adapter_id), PullStats()
        else:
            # An engine's base model is checked before a byte of a miss moves (and a fetch for another base is not shared).
            check = (lambda m: _check_base(request, m)) if request.base_model else None
            # The caller's own grants decide whether bytes are brought for it, from a peer or an origin (invariant 18).
            who = caller()
            resolved = await self.origins.resolve(
                adapter_id, check, flight=request.base_model, may_fetch=lambda: who.check("pull", adapter_id), who=who
            )
            manifest, stats = resolved.manifest, resolved.stats
        self.signed.check_stored(manifest)
        _check_base(request, manifest)
        return manifest, stats

    async def _origin_of(self, adapter_id: str, manifest: Manifest) -> tuple[str, str]:
        """(origin, revision) the id's digest came from; ("", "") when staged or pulled from a peer."""
        if self.origins is None:
            return "", ""
        record = await self.context.io(self.origins.record_of, adapter_id, manifest.digest)
        return (record.revision.origin, record.revision.revision) if record is not None else ("", "")


def _check_base(request: fabric_pb2.PromoteRequest, manifest: Manifest) -> None:
    """The caller's base model (an engine's resolver knows its names, comma-separated), against the adapter's config, before
    it is used: by ``adapter_fabric.format.base_model``'s rule (without case, whole or by the last part of a path or hub id)."""
    named = manifest.config.base_model_name_or_path
    names = [name for name in request.base_model.split(",") if name.strip()]
    if names and not base_model_matches(named, names):
        raise IncompatibleAdapter(f"adapter {manifest.adapter_id!r} is for base model {str(named)[:200]!r}, and the engine serves {', '.join(names)[:300]}")


def _check_peer_address(address: str) -> None:
    """A peer is ``host:port`` over TCP: a ``unix:`` path or any other scheme would reach into this machine."""
    host, _, port = address.rpartition(":")
    if not host or "/" in address or not port.isdigit() or not 0 < int(port) < 65536 or host.lower().startswith(("unix", "vsock")):
        raise InvalidArgument(f"peer address {address[:100]!r} is not host:port (a TCP peer; unix sockets and other schemes are refused)")
