"""Faults: SIGKILL mid-Stage, mid-pull and mid-swap; a full disk; a peer that stalls; load.

One model node (the "victim") is killed and restarted on the same store and
port across the tests; two store-only seeders hold the adapters it pulls (one
fast, one rate-limited so a pull lasts long enough to be killed). After every
restart each committed adapter must be listed with its digest, and its bytes,
fetched back over gRPC, must match the manifest chunk by chunk; nothing
partial may be listed; the next promote must work.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from tests.support import PEERS
from tests.support.relays import GatedRelay
from adapter_fabric.transport import wire
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.errors import FabricError, PeerUnavailable, QuotaExceeded
from adapter_fabric.store.manifest import FileHasher, Manifest, manifest_request
from adapter_fabric.store import AdapterStore
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.transport.pull import PeerPuller
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.store import stage_begin
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

PROMPT = [3, 14, 15, 92, 65, 35]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED_CHUNK = ["--chunk-size", "4096"]
VICTIM_CHUNK = 65536
STALL_TIMEOUT_S = 2
SLOW_RATE = 32 << 10  # bytes/s: the second seeder, which only the relays in front of it reach
LOAD_STREAMS = 32
LOAD_SECONDS = 3.0
LOADED_SAMPLES = 3  # Generates timed under the load, at least


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    specs = {
        "small": dict(r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "other": dict(r=8, target_modules=["o_proj"], seed=2),
        "big": dict(r=16, target_modules=ALL, seed=3),  # ~128 KiB: 32 chunks of 4 KiB
        "lonely": dict(r=8, target_modules=ALL, seed=5),  # held by the slow seeder only
        "huge": dict(r=256, target_modules=ALL, seed=4),  # ~2 MiB: the load test's payload (never promoted)
    }
    return {name: make_peft_adapter(root / name, base_model=base, lora_alpha=8, **spec) for name, spec in specs.items()}


class Victim:
    """The model node under test: same store and port across SIGKILLs."""

    def __init__(self, root: Path, peers: list[str]) -> None:
        self.store = root / "victim"
        self.port = free_port()
        self.peers = peers
        self.node: LocalNode | None = None

    def launch(self) -> None:
        self.node = LocalNode(
            self.store, port=self.port, slots=2, peers=self.peers, extra_args=["--chunk-size", str(VICTIM_CHUNK), "--stall-timeout", str(STALL_TIMEOUT_S)]
        )
        self.node.launch()

    def restart(self) -> None:
        self.node.kill()
        self.launch()
        self.node.wait_ready()

    @property
    def address(self) -> str:
        return self.node.address


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, adapters) -> Iterator[tuple[Victim, LocalNode, LocalNode]]:
    root = tmp_path_factory.mktemp("faults")
    fast = LocalNode(root / "fast", model="none", port=free_port(), extra_args=SEED_CHUNK)
    slow = LocalNode(root / "slow", model="none", port=free_port(), extra_args=[*SEED_CHUNK, "--upload-rate", str(SLOW_RATE)])
    victim = Victim(root, peers=[f"127.0.0.1:{fast.args[1].rsplit(':', 1)[1]}"])
    try:
        for node in (fast, slow):
            node.launch()
        victim.launch()
        for node in (fast, slow, victim.node):
            node.wait_ready()
        for seeder in (fast, slow):
            with NodeClient(seeder.address) as client:
                client.stage(adapters["big"], "big")
        with NodeClient(slow.address) as client:
            client.stage(adapters["lonely"], "lonely")
        with NodeClient(victim.address) as client:
            for name in ("small", "other"):
                client.stage(adapters[name], name)
        yield victim, fast, slow
    finally:
        for node in (fast, slow, victim.node):
            node.stop()


# ---------------------------------------------------------------- checks


def fetch_verified(stub_channel: grpc.Channel, pb: fabric_pb2.Manifest) -> int:
    """Fetch an adapter's weights and check every chunk, and the whole file, against its manifest."""
    manifest = Manifest.from_proto(pb)
    weights = manifest.weights
    whole = FileHasher(weights.chunk_size)
    expected = 0
    for offset, data in wire.fetch_stub(stub_channel)(fabric_pb2.FetchRequest(digest=manifest.digest, file=weights.name), timeout=60):
        assert offset == expected
        weights.verify_chunk(offset // weights.chunk_size, data)
        whole.update(data)
        expected += len(data)
    assert expected == weights.size and whole.entry(weights.name) == weights
    return expected


def committed(address: str) -> dict[str, str]:
    with NodeClient(address) as client:
        return {s.adapter_id: s.digest for s in client.list().staged}


def assert_intact(address: str, expected: dict[str, str]) -> None:
    """Exactly the committed adapters are listed, each with its digest and bytes; nothing partial is."""
    assert committed(address) == expected
    with grpc.insecure_channel(address, options=wire.CHANNEL_OPTIONS) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        for adapter_id, digest in expected.items():
            pb = stub.GetManifest(manifest_request(adapter_id), timeout=30)
            assert pb.digest == digest
            fetch_verified(channel, pb)


def verify_store_offline(root: Path, expected: dict[str, str]) -> None:
    """The same store opened by the library (after the node stopped): re-hash every committed file."""
    store = AdapterStore(root)
    assert {m.adapter_id: m.digest for m in store.list()} == expected
    for adapter_id in expected:
        store.verify(adapter_id)



def weights_size(adapter_dir: Path) -> int:
    return (adapter_dir / "adapter_model.safetensors").stat().st_size


# ---------------------------------------------------------------- SIGKILL


@pytest.mark.slow
def test_sigkill_during_stage(cluster, adapters) -> None:
    victim, _, _ = cluster
    before = committed(victim.address)
    data = (adapters["big"] / "adapter_model.safetensors").read_bytes()
    begin = stage_begin(adapters["big"], "killed/big", VICTIM_CHUNK)
    sha = begin.safetensors_blake3
    gate = threading.Event()

    def requests():
        yield fabric_pb2.StageRequest(begin=begin)
        for offset in range(0, 3 * 8192, 8192):
            yield fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=offset, data=data[offset : offset + 8192]))
        gate.wait(60)  # the stream stays open, mid-file, until the node is gone

    channel = grpc.insecure_channel(victim.address)
    stub = fabric_pb2_grpc.FabricStub(channel)
    errors: list[BaseException] = []
    sender = threading.Thread(target=lambda: _expect_rpc_error(lambda: stub.Stage(requests(), timeout=60), errors))
    sender.start()
    offset = lambda: stub.UploadOffset(fabric_pb2.UploadOffsetRequest(adapter_id="killed/big", safetensors_blake3=sha), timeout=10).offset  # noqa: E731
    wait_for(lambda: offset() == 3 * 8192, "the node to hold 24 KiB of the upload")
    victim.node.kill()
    gate.set()
    sender.join(30)
    channel.close()
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE

    victim.restart()
    assert_intact(victim.address, before)  # "killed/big" is not listed
    with NodeClient(victim.address) as client:
        assert client._call(client.stub.UploadOffset, fabric_pb2.UploadOffsetRequest(adapter_id="killed/big", safetensors_blake3=sha)).offset == 3 * 8192
        reply = client.stage(adapters["big"], "killed/big")  # resumes at 24 KiB
        assert reply.bytes_received == len(data) - 3 * 8192
        assert client.promote("killed/big", name="big").slot >= 0
        assert client.generate(PROMPT, "big", max_new_tokens=2).output_ids
        client.unstage("killed/big")


def _expect_rpc_error(call, errors: list) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        errors.append(exc)


@pytest.mark.slow
def test_sigkill_during_pull(cluster, adapters) -> None:
    """The pull is held mid-file by a gated relay in front of the fast seeder (named peer only), so the kill lands mid-pull."""
    victim, fast, _ = cluster
    before = committed(victim.address)
    partial_root = victim.store / "partial"
    outcome: list[object] = []
    relay = GatedRelay(fast.address, hold_after=4)  # 16 KiB of "big", then nothing until the node is gone

    def pull() -> None:
        with NodeClient(victim.address) as client:
            try:
                outcome.append(client.promote("big", peer=relay.address, name="big", named_peer_only=True))
            except BaseException as exc:  # noqa: BLE001 - the test reads what happened
                outcome.append(exc)

    def written() -> int:  # bytes the partial holds on disk (it is sparse: chunks land as they verify)
        return sum(p.stat().st_blocks * 512 for p in partial_root.glob("*/data"))

    puller = threading.Thread(target=pull)
    puller.start()
    try:
        relay.wait_holding()
        wait_for(lambda: written() >= 16 << 10, "the pull to write the 16 KiB it received")  # held: it cannot finish first
        victim.node.kill()
        puller.join(30)
    finally:
        relay.kill()
    assert not puller.is_alive()
    assert outcome and isinstance(outcome[0], PeerUnavailable), outcome

    victim.restart()
    assert_intact(victim.address, before)  # the partial "big" is not listed
    with NodeClient(victim.address) as client:
        reply = client.promote("big", peer=fast.address, name="big")
        assert 0 < reply.bytes_transferred < weights_size(adapters["big"]), "the pull after a restart must resume, not start over"
        assert client.generate(PROMPT, "big", max_new_tokens=2).output_ids
        client.unstage("big")


@pytest.mark.slow
def test_sigkill_during_swap(cluster, adapters) -> None:
    """Promotes run back to back (2 slots, 3 adapters: every promote evicts and swaps) when SIGKILL lands."""
    victim, _, _ = cluster
    with NodeClient(victim.address) as client:
        client.stage(adapters["big"], "swap/big")
    before = committed(victim.address)
    done: list[int] = []
    stop = threading.Event()

    def promote_forever() -> None:
        with NodeClient(victim.address) as client:
            names = ["small", "other", "swap/big"]
            while not stop.is_set():
                try:
                    client.promote(names[len(done) % 3], name=f"n{len(done) % 3}")
                except FabricError:
                    return
                done.append(1)

    loop = threading.Thread(target=promote_forever)
    loop.start()
    wait_for(lambda: len(done) >= 6, "six promotes")
    victim.node.kill()
    stop.set()
    loop.join(30)

    victim.restart()
    assert_intact(victim.address, before)
    with NodeClient(victim.address) as client:
        for adapter_id in before:
            assert client.promote(adapter_id, name=adapter_id).slot >= 0
        assert client.generate(PROMPT, "small", max_new_tokens=2).output_ids
        client.unstage("swap/big")


# ---------------------------------------------------------------- a peer that stalls


@pytest.fixture
def staller(request, cluster) -> Iterator[tuple[str, subprocess.Popen]]:
    """A stalling relay in front of the fast seeder (default) or the slow one (``indirect`` param "slow")."""
    _, fast, slow = cluster
    upstream = slow if getattr(request, "param", "fast") == "slow" else fast
    relay = subprocess.Popen([sys.executable, str(PEERS / "stalling_peer.py"), upstream.address, "--chunks", "3"], stdout=subprocess.PIPE, text=True)
    try:
        yield relay.stdout.readline().split()[-1], relay
    finally:
        relay.kill()
        relay.wait()


@pytest.mark.slow
def test_stalled_peer_is_dropped_and_the_pull_fails_over(cluster, staller, adapters) -> None:
    """The victim knows the fast seeder as a peer: the stalled relay's chunks are asked of it instead."""
    victim, fast, _ = cluster
    address, relay = staller
    started = time.monotonic()
    # The client's deadline is the bound: a pull stuck on the relay would end in DEADLINE_EXCEEDED.
    with NodeClient(victim.address, timeout=60) as client:
        reply = client.promote("big", peer=address, name="big")
        elapsed = time.monotonic() - started
        assert set(reply.source_peer.split(",")) == {address, fast.address}
        assert client.generate(PROMPT, "big", max_new_tokens=2).output_ids
        client.unstage("big")
    assert relay.stdout.readline().startswith("stalled at offset")
    assert_intact(victim.address, committed(victim.address))
    print(f"\nstalled peer, second holder known: promote completed in {elapsed:.1f}s (stall timeout {STALL_TIMEOUT_S}s)")


@pytest.mark.slow
@pytest.mark.parametrize("staller", ["slow"], indirect=True)
def test_stalled_only_holder_is_timed_out_by_the_node(cluster, staller, adapters) -> None:
    """Only the relay holds "lonely" (its upstream is the slow seeder, which the victim does not know)."""
    victim, _, _ = cluster
    address, relay = staller
    before = committed(victim.address)
    started = time.monotonic()
    with NodeClient(victim.address, timeout=60) as client:
        with pytest.raises(PeerUnavailable, match=rf"sent nothing for {STALL_TIMEOUT_S}s") as info:
            client.promote("lonely", peer=address, name="lonely")
        elapsed = time.monotonic() - started
    assert "kept for resume" in str(info.value)
    assert committed(victim.address) == before
    assert relay.stdout.readline().startswith("stalled at offset")
    print(f"\nstalled only holder: UNAVAILABLE after {elapsed:.1f}s (stall timeout {STALL_TIMEOUT_S}s): {info.value}")


@pytest.mark.slow
def test_stalled_only_peer_gives_unavailable(tmp_path, staller) -> None:
    address, _ = staller
    store = AdapterStore(tmp_path / "store")
    puller = PeerPuller(store, stall_timeout=STALL_TIMEOUT_S)
    try:
        with pytest.raises(PeerUnavailable, match=rf"sent nothing for {STALL_TIMEOUT_S}s.*kept for resume|kept for resume.*sent nothing for {STALL_TIMEOUT_S}s"):
            puller.pull([address], "big")
    finally:
        puller.channels.close()
    assert store.list() == []


# ---------------------------------------------------------------- disk full




@pytest.mark.slow
def test_disk_full_during_pull(cluster, small_disk, adapters, tmp_path) -> None:
    _, fast, _ = cluster
    node = LocalNode(small_disk / "store", port=free_port(), log_path=tmp_path / "node.log", extra_args=SEED_CHUNK).start()
    try:
        with NodeClient(node.address) as client:
            client.stage(adapters["small"], "small")
            before = committed(node.address)
            blobs_before = sorted(p.name for p in (small_disk / "store" / "blobs").rglob("*") if p.is_file())
            free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
            filler = small_disk / "filler"
            filler.write_bytes(b"\0" * (free - (48 << 10)))  # leave 48 KiB: "big" needs ~128 KiB
            with pytest.raises(QuotaExceeded, match="disk holding the adapter store is full"):
                client.promote("big", peer=fast.address, name="big")
            assert committed(node.address) == before
            assert sorted(p.name for p in (small_disk / "store" / "blobs").rglob("*") if p.is_file()) == blobs_before
            assert any((small_disk / "store" / "partial").iterdir()), "the verified chunks stay in partial/ for a resume"
            filler.unlink()  # space freed: the same pull now completes (resuming what was verified)
            reply = client.promote("big", peer=fast.address, name="big")
            assert 0 < reply.bytes_transferred <= weights_size(adapters["big"])
            assert client.generate(PROMPT, "big", max_new_tokens=2).output_ids
        assert_intact(node.address, {**before, "big": reply.digest})
    finally:
        node.stop()


def test_quota_error_maps_to_resource_exhausted() -> None:
    from adapter_fabric.rpc.status import status_code_for

    assert status_code_for(QuotaExceeded("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------- load


def _latencies(client: NodeClient, count: int | None = None, until: threading.Event | None = None, found: list[float] | None = None) -> list[float]:
    """Time Generates, ``count`` of them or until ``until`` is set, each appended to ``found`` as it ends (others may watch it)."""
    found = [] if found is None else found
    while (count is not None and len(found) < count) or (until is not None and not until.is_set()):
        started = time.perf_counter()
        assert client.generate(PROMPT, "small", max_new_tokens=4).output_ids
        found.append(time.perf_counter() - started)
    return found


def _describe(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"n={len(ordered)} p50={statistics.median(ordered) * 1e3:.1f} ms p95={p95 * 1e3:.1f} ms max={ordered[-1] * 1e3:.1f} ms"


@pytest.mark.slow
def test_load_32_fetch_streams_while_generating(cluster, adapters) -> None:
    victim, _, _ = cluster
    with NodeClient(victim.address) as client:
        client.stage(adapters["huge"], "load/huge")
        client.promote("small", name="small")
        pb = client.manifest_proto("load/huge")
        idle = _latencies(client, count=20)
        deadline = time.monotonic() + LOAD_SECONDS
        finished = threading.Event()
        moved: list[int] = [0] * LOAD_STREAMS
        loaded: list[float] = []

        def stream(index: int) -> None:
            with grpc.insecure_channel(victim.address, options=wire.CHANNEL_OPTIONS) as channel:
                # the load lasts until the generator has had a few Generates under it (a loaded box may start it late)
                while time.monotonic() < deadline or len(loaded) < LOADED_SAMPLES:
                    moved[index] += fetch_verified(channel, pb)

        with ThreadPoolExecutor(LOAD_STREAMS) as pool:
            futures = [pool.submit(stream, i) for i in range(LOAD_STREAMS)]
            generator = threading.Thread(target=_latencies, args=(client,), kwargs={"until": finished, "found": loaded})
            generator.start()
            started = time.monotonic()
            for future in futures:
                future.result()  # any error or unverified byte fails here
            elapsed = time.monotonic() - started
            finished.set()
            generator.join(60)
        client.unstage("load/huge")
    assert all(moved) and len(loaded) >= LOADED_SAMPLES
    total = sum(moved)
    print(
        f"\nload: {LOAD_STREAMS} Fetch streams moved {total / 2**20:.0f} MiB in {elapsed:.1f}s ({total / 2**20 / elapsed:.0f} MiB/s), every chunk verified"
        f"\nGenerate (4 new tokens) idle:       {_describe(idle)}"
        f"\nGenerate (4 new tokens) under load: {_describe(loaded)}"
    )
