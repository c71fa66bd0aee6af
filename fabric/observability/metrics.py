"""Every metric a node exports, in one place (the README's Metrics table is checked against ``catalog()``).

Names follow the Prometheus conventions: a ``fabric_`` prefix, ``_total`` on
counters, ``_seconds`` and ``_bytes`` units. Labels are bounded: ``outcome``
is ``ok`` or an error type of ``adapter_fabric.errors`` (or a gRPC code name),
``peer`` is a known peer's address or ``other``, ``method`` a Fabric RPC,
``slot`` one per slot. Gauges of state (slots, store) are set just before each
scrape by the node (``set_refresh``), so they are never stale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, Info, ProcessCollector, disable_created_metrics, generate_latest
from prometheus_client.metrics import MetricWrapperBase

disable_created_metrics()  # the _created series double the output and no dashboard here reads them
REGISTRY = CollectorRegistry(auto_describe=True)
# the client's standard series beside ours: process_* (CPU, resident memory, open files) and python_gc_* (collections)
ProcessCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

#: latency buckets (seconds) from a cached promote (~ms) to a slow multi-GB pull
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OK = "ok"
OTHER_PEER = "other"

BUILD = Info("fabric_build", "The node's version.", registry=REGISTRY)
BUILD_LABELS = ("version",)  # an Info's labels are the keys it is given at start
HEAP_FROZEN = Gauge(
    "fabric_heap_frozen_objects", "Objects frozen once the node was built (its imports, model and store): no garbage collection scans them again.",
    registry=REGISTRY,
)
READY = Gauge("fabric_ready", "1 once store recovery and model load finished, 0 before and while draining.", registry=REGISTRY)

SLOTS = Gauge("fabric_slots", "Adapter slots in the pool (0 on a store-only node).", registry=REGISTRY)
SLOTS_FILLED = Gauge("fabric_slots_filled", "Slots holding an adapter.", registry=REGISTRY)
SLOTS_PINNED = Gauge("fabric_slots_pinned", "Slots pinned against eviction.", registry=REGISTRY)
SLOTS_BUSY = Gauge("fabric_slots_busy", "Slots a running sequence holds (ref count above 0).", registry=REGISTRY)
RESIDENT = Gauge(
    "fabric_resident_adapter_info", "1 for each adapter resident in a slot (one series per filled slot; adapter empty unless --metrics-adapter-labels).",
    ["slot", "adapter", "content_id"], registry=REGISTRY,
)

PROMOTES = Counter("fabric_promotes_total", "Promote calls that load a slot, by outcome.", ["outcome"], registry=REGISTRY)
PROMOTE_SECONDS = Histogram(
    "fabric_promote_duration_seconds", "Promote latency, pull included (outcome ok or error).", ["outcome"], buckets=LATENCY_BUCKETS, registry=REGISTRY
)
PULLS = Counter("fabric_pulls_total", "Pulls of an adapter from peers, by outcome.", ["outcome"], registry=REGISTRY)
PULL_SECONDS = Histogram("fabric_pull_duration_seconds", "Pull latency (outcome ok or error).", ["outcome"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
PULL_BYTES = Counter("fabric_pull_received_bytes_total", "Verified bytes received from peers, by source peer (unknown peers: other).", ["peer"], registry=REGISTRY)
PULL_RESUMES = Counter("fabric_pull_resumes_total", "Pulls that resumed from chunks verified by an earlier, interrupted pull.", registry=REGISTRY)
PULL_FAILOVERS = Counter("fabric_pull_failovers_total", "Peers dropped during a pull while chunks were still missing.", registry=REGISTRY)
SERVED_BYTES = Counter("fabric_served_bytes_total", "Adapter bytes sent to peers in Fetch responses.", registry=REGISTRY)
UPLOAD_SLOT_WAITS = Counter(
    "fabric_upload_slot_waits_total", "Fetch streams that found every upload slot (--upload-slots) taken, by outcome: queued (a slot freed within the wait bound) or past_bound (sent without one after it).",
    ["outcome"], registry=REGISTRY,
)
PARTIAL_CHUNKS_SERVED = Counter(
    "fabric_partial_chunks_served_total", "Chunks of a download still arriving here served to peers, by how: sendfile (its file, unchanged since verified), reverified (the file changed on disk) or committed (meanwhile: from the blob).",
    ["how"], registry=REGISTRY,
)
FETCH_STREAMS = Counter("fabric_fetch_streams_total", "Fetch streams this node opened to peers, by channel: data (the data channel) or grpc.", ["channel"], registry=REGISTRY)
DATA_FALLBACKS = Counter(
    "fabric_data_channel_fallbacks_total",
    "Fetches sent over gRPC because a peer's announced data channel could not be reached (connect, tls), refused the stream for its connection bound (busy), or broke before its first frame (broken), by reason.",
    ["reason"], registry=REGISTRY,
)
DATA_CONNECTIONS = Counter(
    "fabric_data_channel_connections_total", "Data channel streams this node opened to peers, by connection: new (a connect) or kept (one an earlier stream to the same peer left open).",
    ["connection"], registry=REGISTRY,
)
DATA_STREAMS_SERVED = Counter("fabric_data_channel_streams_total", "Streams this node's data channel answered, by outcome (ok, refused, broken; shed: an idle connection closed to make room).", ["outcome"], registry=REGISTRY)
STAGES = Counter("fabric_stage_uploads_total", "Stage uploads from clients, by outcome.", ["outcome"], registry=REGISTRY)
STAGE_BYTES = Counter("fabric_stage_received_bytes_total", "Adapter bytes received by Stage.", registry=REGISTRY)

STORE_USED = Gauge("fabric_store_used_bytes", "Bytes the store holds: blobs, partial downloads and uploads.", registry=REGISTRY)
STORE_QUOTA = Gauge("fabric_store_quota_bytes", "The store's limit, --max-store-bytes (0 = no limit but the disk).", registry=REGISTRY)
EVICTIONS = Counter("fabric_store_evictions_total", "Cold adapters (digests) dropped to make room for a commit past --max-store-bytes.", registry=REGISTRY)
EVICTED_BYTES = Counter("fabric_store_evicted_bytes_total", "Bytes freed by evicting cold adapters.", registry=REGISTRY)
ENGINE_ADAPTERS = Gauge("fabric_engine_adapters", "Adapters of this node an engine (--engine-url) lists in GET /v1/models, as last read, by engine.", ["engine"], registry=REGISTRY)
ORIGIN_FETCHES = Counter(
    "fabric_origin_fetches_total", "Fetches of an adapter from an origin (--origin), by origin and outcome (ok, or the error type: AdapterNotFound, "
    "OriginUnavailable, OriginTooSlow, LimitExceeded, InvalidHeader, ...).", ["origin", "outcome"], registry=REGISTRY,
)
ORIGIN_BYTES = Counter("fabric_origin_received_bytes_total", "Adapter bytes received from origins, by origin.", ["origin"], registry=REGISTRY)
ORIGIN_REVALIDATIONS = Counter(
    "fabric_origin_revalidations_total", "Ids revalidated with their origin after --origin-ttl, by origin and result (unchanged, changed, failed).",
    ["origin", "result"], registry=REGISTRY,
)
ORIGIN_ERRORS = Counter(
    "fabric_origin_errors_total", "Origin fetches that failed other than by a miss (the origin down, slow, or its content refused), by origin and error type.",
    ["origin", "kind"], registry=REGISTRY,
)
ENGINE_MOVED_UNLOADS = Counter(
    "fabric_engine_moved_unloads_total", "Adapters unloaded from an engine (--engine-url, vLLM) because their id moved to a new digest, by engine "
    "and outcome (ok, already, failed).", ["engine", "outcome"], registry=REGISTRY,
)
ENGINE_READS = Counter("fabric_engine_reads_total", "Reads of an engine's GET /v1/models, by engine and outcome (ok, cut, failed).", ["engine", "outcome"], registry=REGISTRY)
ENGINE_LOADS = Counter("fabric_engine_loads_total", "Adapters loaded into the driven SGLang (--sglang-url), by outcome (ok, already, failed).", ["outcome"], registry=REGISTRY)
ENGINE_UNLOADS = Counter("fabric_engine_unloads_total", "Adapters unloaded from the driven SGLang (--sglang-url), by outcome (ok, already, failed).", ["outcome"], registry=REGISTRY)
HANDOFFS = Counter(
    "fabric_store_handoffs_total", "Last copies handed to a durable peer (it pulled them) before they were evicted, by outcome.", ["outcome"], registry=REGISTRY
)
MEMBERS = Gauge("fabric_members", "Members of the fleet this node sees (--peers, --peers-dns, --peers-k8s), by state: up, or down (skipped a while).", ["state"], registry=REGISTRY)
LOOKUP_CALLS = Counter(
    "fabric_lookup_calls_total", "Calls lookups made to find where to pull an adapter from, by kind: home (asked at a home), probe (a holder's load), fanout "
    "(a member beyond the homes).", ["kind"], registry=REGISTRY,
)  # fmt: skip
LOOKUP_FANOUTS = Counter("fabric_lookup_fanouts_total", "Lookups that asked members beyond the adapter's homes (no home could name a holder).", registry=REGISTRY)
HOME_PUSHES = Counter(
    "fabric_home_pushes_total", "Adapters this node had a home pull from it, by why (publish, rehome, handoff) and outcome (ok, failed, dropped: the queue was full).",
    ["why", "outcome"], registry=REGISTRY,
)  # fmt: skip
ANNOUNCES = Counter("fabric_announces_total", "Holdings (or drops) this node told an adapter's homes of, by outcome (ok, failed; dropped: not queued, past a re-homing's bound).", ["outcome"], registry=REGISTRY)
EXPIRED = Counter("fabric_store_expired_total", "Abandoned uploads and partial downloads removed for age, by kind.", ["kind"], registry=REGISTRY)
EXPIRED_BYTES = Counter("fabric_store_expired_bytes_total", "Bytes freed by expiring abandoned uploads and partial downloads.", registry=REGISTRY)

ACCESS_REFUSALS = Counter("fabric_access_refusals_total", "Calls the access policy refused (PERMISSION_DENIED), by the verb they lacked.", ["verb"], registry=REGISTRY)
POLICY_RELOADS = Counter("fabric_policy_reloads_total", "Reloads of --policy (SIGHUP or a changed file), by outcome: ok, or refused (the previous policy kept).", ["outcome"], registry=REGISTRY)
RPC_SECONDS = Histogram("fabric_rpc_duration_seconds", "Latency of every Fabric RPC but Fetch, by method.", ["method"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
RPC_ERRORS = Counter("fabric_rpc_errors_total", "RPCs (all but Fetch) that ended with a status other than OK, by method and gRPC code.", ["method", "code"], registry=REGISTRY)
GENERATE_SECONDS = Histogram("fabric_generate_duration_seconds", "Generate latency.", buckets=LATENCY_BUCKETS, registry=REGISTRY)

_refresh: list[Callable[[], None]] = []
_scrape_lock = threading.Lock()


def set_refresh(hook: Callable[[], None] | None) -> None:
    """The hook that sets the state gauges (slots, store) right before a scrape; None removes it."""
    _refresh[:] = [hook] if hook is not None else []


def scrape() -> bytes:
    """The Prometheus text exposition of every metric, state gauges refreshed first."""
    with _scrape_lock:  # one refresh at a time: clearing RESIDENT must not race another scrape's refill
        for hook in _refresh:
            hook()
        return generate_latest(REGISTRY)


def peer_label(peer: str, known: Iterable[str]) -> str:
    """``peer`` when it is a known peer, else ``other``: an unbounded set of callers must not become series."""
    return peer if peer in set(known) else OTHER_PEER


class MetricInfo(NamedTuple):
    name: str  # as exposed: counters end in _total, Info in _info
    kind: str
    labels: tuple[str, ...]
    help: str


def catalog() -> list[MetricInfo]:
    """Every metric as exposed: name, type, labels and help (the README table is checked against this)."""
    found = []
    for value in globals().values():
        if isinstance(value, MetricWrapperBase):
            name = value._name + {"counter": "_total", "info": "_info"}.get(str(value._type), "")
            labels = BUILD_LABELS if value is BUILD else tuple(value._labelnames)
            found.append(MetricInfo(name, str(value._type), labels, value._documentation))
    return sorted(found)
