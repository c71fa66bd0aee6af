"""What ``NodeClient`` calls return: plain dataclasses, not protobuf messages.

Each has ``to_dict()`` for JSON: 64-bit content ids become strings in the
text output's form, ``0x`` and 16 hex digits (JavaScript and ``jq`` lose
precision past 2**53 as numbers), everything else stays as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from adapter_fabric.v1 import fabric_pb2

#: fields holding u64 values that JSON numbers cannot carry exactly
_U64_FIELDS = frozenset({"content_id"})


def hex_id(content_id: int) -> str:
    """A u64 content id as the CLI shows it, in text and JSON alike: ``0x`` and 16 hex digits."""
    return f"{content_id:#018x}"


def json_ready(value: Any) -> Any:
    """``value`` with every u64 id field rendered as ``hex_id`` (recursing through dicts and lists)."""
    if isinstance(value, dict):
        return {k: (hex_id(v) if k in _U64_FIELDS and isinstance(v, int) else json_ready(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


class _Result:
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (u64 ids as ``0x`` hex strings)."""
        return json_ready(asdict(self))  # type: ignore[call-overload]


@dataclass(frozen=True)
class StageResult(_Result):
    """A committed upload. ``resumed_from``: bytes the node already held from an interrupted upload (0: from the start).

    ``already_staged``: the same content (digest) was in the store already, under this id or another: nothing new stored.
    """

    adapter_id: str
    digest: str
    content_id: int
    bytes_received: int
    already_staged: bool
    resumed_from: int = 0


@dataclass(frozen=True)
class PromoteResult(_Result):
    """A promote (or a stage-only pull). ``slot`` is -1 for a pull; ``source_peers``: every peer that sent bytes.

    ``bytes_transferred`` counts the weights file's bytes this call moved (the config travels in the manifest).
    ``joined``: the node was already pulling this digest (say, for a client interrupted by Ctrl-C) and this call
    waited for that pull; it moved nothing itself. No source peers and not joined: the bytes were already here.
    """

    slot: int
    evicted_name: str
    content_id: int
    digest: str
    bytes_transferred: int
    source_peers: list[str]
    pull_seconds: float
    joined: bool = False
    #: the origin the id's digest came from (--origin) and its revision there; empty when staged or from a peer
    origin: str = ""
    revision: str = ""
    #: with ``export_version``: the export directory entry named by this digest
    export_name: str = ""

    @property
    def source_peer(self) -> str:
        """The sources comma-separated, preferred first (the wire's form)."""
        return ",".join(self.source_peers)

    @classmethod
    def from_proto(cls, pb: fabric_pb2.PromoteResponse) -> PromoteResult:
        return cls(
            slot=pb.slot,
            evicted_name=pb.evicted_name,
            content_id=pb.content_id,
            digest=pb.digest,
            bytes_transferred=pb.bytes_transferred,
            source_peers=[p for p in pb.source_peer.split(",") if p],
            pull_seconds=pb.pull_seconds,
            joined=pb.joined,
            origin=pb.origin,
            revision=pb.revision,
            export_name=pb.export_name,
        )


@dataclass(frozen=True)
class PeftSummary(_Result):
    """The LoRA fields of an adapter's config that decide how it is applied."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules_pattern: str = ""

    @classmethod
    def from_proto(cls, pb: fabric_pb2.PeftFields) -> PeftSummary:
        return cls(
            r=pb.r,
            lora_alpha=pb.lora_alpha,
            use_rslora=pb.use_rslora,
            target_modules=list(pb.target_modules),
            rank_pattern=dict(pb.rank_pattern),
            alpha_pattern=dict(pb.alpha_pattern),
            target_modules_pattern=pb.target_modules_pattern,
        )


@dataclass(frozen=True)
class StagedAdapter(_Result):
    """An adapter in a node's store."""

    adapter_id: str
    digest: str
    content_id: int
    #: bytes of every file of it as stored (config and weights); a pull's ``bytes_transferred`` counts weights only
    size: int
    peft: PeftSummary
    #: non-empty when the node cannot load or serve it as it is: why (adapter_fabric.store.integrity)
    damaged: str = ""
    #: the engines beside the node (host:port, --engine-url) whose GET /v1/models lists it, as the node last read them
    engines: tuple[str, ...] = ()
    #: from an origin (--origin): its URI, the revision this digest is, and when the node last confirmed it (unix seconds)
    origin: str = ""
    revision: str = ""
    checked_at: float = 0.0


@dataclass(frozen=True)
class SlotInfo(_Result):
    """One slot of a node's pool; ``name`` is None while it was never filled (``empty``)."""

    slot: int
    name: str | None
    content_id: int
    ref_count: int
    pinned: bool
    active: bool
    last_used: int
    rank: int
    digest: str

    @property
    def empty(self) -> bool:
        """Never filled: no adapter, content id 0, nothing else to show."""
        return self.name is None


@dataclass(frozen=True)
class Listing(_Result):
    """A node's staged adapters and slots (no slots on a store-only node)."""

    staged: list[StagedAdapter]
    slots: list[SlotInfo]
    max_rank: int
    device: str

    @classmethod
    def from_proto(cls, pb: fabric_pb2.ListAdaptersResponse) -> Listing:
        staged = [StagedAdapter(a.adapter_id, a.digest, a.content_id, a.size, PeftSummary.from_proto(a.peft), a.damaged, tuple(a.engines),
                                a.origin, a.revision, a.checked_at) for a in pb.staged]
        slots = [SlotInfo(s.slot, s.name or None, s.content_id, s.ref_count, s.pinned, s.active, s.last_used, s.rank, s.digest) for s in pb.slots]
        return cls(staged=staged, slots=slots, max_rank=pb.max_rank, device=pb.device)


@dataclass(frozen=True)
class PeerHolding(_Result):
    """A peer holding an adapter's bytes, fully or the first ``verified_chunks`` chunks' worth."""

    address: str
    complete: bool
    verified_chunks: int


@dataclass(frozen=True)
class Location(_Result):
    """Which of a node's known peers hold an adapter (the node itself is not listed)."""

    digest: str
    peers: list[PeerHolding]


@dataclass(frozen=True)
class Grant(_Result):
    """Verbs on id prefixes (``*``: every id)."""

    verbs: list[str]
    prefixes: list[str]


@dataclass(frozen=True)
class Identity(_Result):
    """Who the caller is to a node (``fabric whoami``): its principal, its grants, and whether the node runs with a policy."""

    principal: str
    grants: list[Grant]
    policy: bool

    @classmethod
    def from_proto(cls, reply: fabric_pb2.WhoAmIResponse) -> Identity:
        return cls(reply.principal, [Grant(list(g.verbs), list(g.prefixes)) for g in reply.grants], reply.policy)


@dataclass(frozen=True)
class Availability(_Result):
    """Which chunks of a digest a node holds verified; bit i (LSB first in byte i/8) is chunk i."""

    complete: bool
    chunk_count: int
    verified_bitmap: bytes

    @property
    def verified_chunks(self) -> int:
        """How many chunks are verified."""
        return sum(bin(b).count("1") for b in self.verified_bitmap)


@dataclass(frozen=True)
class ActiveSlot(_Result):
    """The slot (and content id) a node's active adapter is in."""

    slot: int
    content_id: int


@dataclass(frozen=True)
class GenerateResult(_Result):
    """Greedy output token ids (and, if asked, the last prompt position's logits) from the slot that ran."""

    output_ids: list[int]
    last_logits: list[float]
    slot: int
    content_id: int


@dataclass(frozen=True)
class StoreLeftover(_Result):
    """An upload or partial download the store keeps to resume. ``digest``: a partial's adapter digest, an upload's weights BLAKE3."""

    adapter_id: str
    digest: str
    bytes: int  # what it counts against --max-store-bytes
    age_seconds: float  # since its last write
    in_use: bool  # a stream is writing it now (never expired while so)


@dataclass(frozen=True)
class DamagedEntry(_Result):
    """A store entry that failed verification (quarantined; pulled again from a peer when one has it)."""

    adapter_id: str
    digest: str
    reason: str


@dataclass(frozen=True)
class TenantUsage(_Result):
    """A per-tenant quota (an id prefix; 0: not limited) and what the prefix holds, committed plus reserved by open writers."""

    prefix: str
    max_bytes: int
    max_adapters: int
    bytes: int
    adapters: int


@dataclass(frozen=True)
class EvictedAdapter(_Result):
    """A cold adapter an evicting node dropped: the ids that named it, its digest and bytes, how long ago, and for what."""

    adapter_ids: list[str]
    digest: str
    bytes: int
    age_seconds: float
    reason: str


@dataclass(frozen=True)
class OriginState(_Result):
    """How one --origin answered the node last: ids it gave are served on while it does not answer."""

    origin: str
    answering: bool
    error: str  # why it did not answer last ("" when it did)
    since: float  # unix seconds of the last change (0: not asked yet)


@dataclass(frozen=True)
class StoreStatus(_Result):
    """A node's store: bytes used and the quota (0: no limit but the disk), what it keeps to resume, what is damaged."""

    used_bytes: int
    quota_bytes: int
    adapters: int
    uploads: list[StoreLeftover]
    partials: list[StoreLeftover]
    expire_after_seconds: float  # 0: abandoned entries are kept
    damaged: list[DamagedEntry]
    evictions: int = 0  # cold adapters evicted since the node started
    kept: int = 0  # adapter ids an operator kept (fabric keep)
    evicts: bool = False  # the node evicts cold adapters at its limit (--when-full evict), else refuses
    tenants: list[TenantUsage] = field(default_factory=list)  # one per per-tenant quota of the node's --policy
    # the lists above hold at most 100 entries each; these count them all
    uploads_total: int = 0
    partials_total: int = 0
    damaged_total: int = 0
    recent_evictions: list[EvictedAdapter] = field(default_factory=list)  # the latest (at most 20), newest first
    origins: list[OriginState] = field(default_factory=list)  # one per --origin: how it answered last

    @classmethod
    def from_proto(cls, pb: fabric_pb2.StoreStatusResponse) -> StoreStatus:
        """The result of a ``StoreStatusResponse``."""
        def leftovers(items) -> list[StoreLeftover]:
            return [StoreLeftover(i.adapter_id, i.digest, i.bytes, i.age_seconds, i.in_use) for i in items]

        return cls(
            pb.used_bytes, pb.quota_bytes, pb.adapters, leftovers(pb.uploads), leftovers(pb.partials), pb.expire_after_seconds,
            [DamagedEntry(d.adapter_id, d.digest, d.reason) for d in pb.damaged], pb.evictions, pb.kept, pb.evicts,
            [TenantUsage(t.prefix, t.max_bytes, t.max_adapters, t.bytes, t.adapters) for t in pb.tenants],
            pb.uploads_total, pb.partials_total, pb.damaged_total,
            [EvictedAdapter(list(e.adapter_ids), e.digest, e.bytes, e.age_seconds, e.reason) for e in pb.recent_evictions],
            [OriginState(o.origin, o.answering, o.error, o.since) for o in pb.origins],
        )
