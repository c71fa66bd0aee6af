"""Integration: real node processes on loopback, talking fabric.v1 to each other."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support import PEERS
from tests.support.relays import GatedRelay
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalCluster, LocalNode, free_port
from adapter_fabric.errors import (
    AdapterNotFound,
    AdaptersUnsupported,
    ConfigMismatch,
    IncompatibleAdapter,
    InvalidAdapterId,
    PeerUnavailable,
)
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2

pytestmark = pytest.mark.slow  # real node processes (the quick tier leaves them out: -m 'not slow')

PROMPT = [3, 14, 15, 92, 65, 35]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL_CHUNK = ["--chunk-size", "4096"]
MESH = ["--homes", "0"]  # no placement: every peer asked, a Stage pushed nowhere


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    specs = {
        "alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
        "beta": dict(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True, seed=2),
        "gamma": dict(r=16, lora_alpha=8, target_modules=["q_proj", "down_proj"], rank_pattern={"down_proj": 2}, seed=3),
        "delta": dict(r=2, lora_alpha=4, target_modules=["o_proj"], seed=4),
        # ~128 KiB: with 4 KiB chunks and a slow seeder, a transfer lasts seconds.
        "big": dict(r=16, lora_alpha=16, target_modules=ALL, seed=5),
        "too-wide": dict(r=32, lora_alpha=32, target_modules=["q_proj"], seed=6),
    }
    return {name: make_peft_adapter(root / name, base_model=base, **spec) for name, spec in specs.items()}


def reference_logits(adapter_dir: Path) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(build_tiny_model(), adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def weights_size(adapter_dir: Path) -> int:
    return (adapter_dir / "adapter_model.safetensors").stat().st_size


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three nodes as a mesh (``--homes 0``, an operator's choice): a Stage stays on its node, so each promote naming a peer
    below moves the bytes it counts. With placement (the default) three nodes are every id's homes and a Stage is pushed
    to all of them (tests/node/test_homes.py)."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), 3, slots=2, extra_args=[*SMALL_CHUNK, *MESH]) as running:
        yield running


@pytest.fixture(scope="module")
def clients(cluster):
    clients = [NodeClient(node.address) for node in cluster.nodes]
    yield clients
    for client in clients:
        client.close()


def test_chain_a_b_c_matches_peft(cluster, clients, adapters) -> None:
    a, b, c = clients
    staged = a.stage(adapters["alpha"], "chain/alpha")
    on_b = b.promote("chain/alpha", peer=cluster.nodes[0].address, name="alpha")
    on_c = c.promote("chain/alpha", peer=cluster.nodes[1].address, name="alpha")  # B serves what it pulled

    assert on_b.digest == on_c.digest == staged.digest
    assert on_b.content_id == on_c.content_id == staged.content_id != 0
    assert on_b.bytes_transferred == on_c.bytes_transferred == weights_size(adapters["alpha"])
    # C pulls from B first and, as a swarm, from its other known peer (A) too: B served part of what it pulled.
    assert on_c.source_peer.split(",")[0] == cluster.nodes[1].address
    got = torch.tensor(c.generate(PROMPT, "alpha", return_logits=True).last_logits)
    assert (got - reference_logits(adapters["alpha"])).abs().max().item() < 1e-5
    assert "chain/alpha" in {s.adapter_id for s in c.list().staged}
    # Both pulls staged the slot row from the chunks as they landed (adapter_fabric.serving.row_sink), not from the blob after.
    for node in cluster.nodes[1:]:
        assert "promoted chain/alpha as 'alpha' into slot" in node.log_path.read_text()
        assert "row staged while receiving" in node.log_path.read_text()
        assert "evicted None" not in node.log_path.read_text() and "nothing evicted" in node.log_path.read_text()


def test_evicted_names_follow_lru(cluster, clients, adapters) -> None:
    a = clients[0]
    for name in ("beta", "gamma", "delta"):
        a.stage(adapters[name], f"lru/{name}")
    assert a.promote("lru/beta", name="beta").evicted_name == ""
    assert a.promote("lru/gamma", name="gamma").evicted_name == ""
    a.generate(PROMPT, "beta")  # beta is now more recent than gamma
    assert a.promote("lru/delta", name="delta").evicted_name == "gamma"
    assert a.promote("lru/gamma", name="gamma").evicted_name == "beta"
    slots = {s.name: s for s in a.list().slots}
    assert set(slots) == {"gamma", "delta"}
    assert slots["gamma"].last_used > slots["delta"].last_used


def test_errors_map_to_status_codes(cluster, clients, adapters) -> None:
    a, b, _ = clients
    peer = cluster.nodes[0].address
    with pytest.raises(AdapterNotFound, match="no-such"):
        b.promote("no-such", peer=peer)
    with pytest.raises(InvalidAdapterId, match=r"\.\."):
        b.promote("../etc", peer=peer)
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(PeerUnavailable, match=dead):  # the known peers answer, but none holds it
        b.promote("held-nowhere", peer=dead)
    # A dead peer is not fatal while a known peer holds the adapter: failover.
    assert b.promote("chain/alpha", peer=dead, name="alpha-failover").digest
    a.stage(adapters["too-wide"], "errors/too-wide")
    with pytest.raises(IncompatibleAdapter, match="32"):
        b.promote("errors/too-wide", peer=peer)
    with pytest.raises(ConfigMismatch, match=r"r: asked 4, staged 8"):
        b.promote("chain/alpha", peer=peer, peft=fabric_pb2.PeftFields(r=4))
    # Refused before a byte moved: B holds nothing of too-wide.
    assert "errors/too-wide" not in {s.adapter_id for s in b.list().staged}


def test_corrupt_chunk_on_the_wire_is_refetched(cluster, clients, adapters) -> None:
    a, b, _ = clients
    a.stage(adapters["beta"], "corrupt/beta")
    relay = subprocess.Popen(
        [sys.executable, str(PEERS / "corrupting_peer.py"), cluster.nodes[0].address, "--times", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = relay.stdout.readline().split()[-1]
        reply = b.promote("corrupt/beta", peer=address, name="beta-via-relay")
        assert "flipped" in relay.stdout.readline()
    finally:
        relay.kill()
        relay.wait()
    size = weights_size(adapters["beta"])
    assert reply.bytes_transferred > size  # the bad chunk crossed twice
    got = torch.tensor(b.generate(PROMPT, "beta-via-relay", return_logits=True).last_logits)
    assert (got - reference_logits(adapters["beta"])).abs().max().item() < 1e-5


def test_ten_concurrent_promotes_move_the_bytes_once(cluster, clients, adapters) -> None:
    a, _, c = clients
    a.stage(adapters["big"], "fanin/big")
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda i: c.promote("fanin/big", peer=cluster.nodes[0].address, name=f"big{i}"), range(10)))
    assert {r.digest for r in replies} == {replies[0].digest}
    assert sum(r.bytes_transferred for r in replies) == weights_size(adapters["big"])


def test_health_and_reflection(cluster) -> None:
    with grpc.insecure_channel(cluster.nodes[0].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "fabric.v1.Fabric"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
        assert "fabric.v1.Fabric" in names and "grpc.health.v1.Health" in names


# ------------------------------------------------------------ faults, own nodes


def test_health_turns_not_serving_on_sigterm(tmp_path) -> None:
    node = LocalNode(tmp_path / "n", model="none").start()
    seen: list[int] = []
    with grpc.insecure_channel(node.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        seen.append(next(watch).status)
        node.process.send_signal(15)
        try:
            for update in watch:
                seen.append(update.status)
                if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break  # seen: leaving the watch lets the drain end now, not at its timeout
        except grpc.RpcError:
            pass
    assert node.process.wait(30) == 0
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen[1:]


def test_store_only_node_serves_but_cannot_promote(tmp_path, adapters) -> None:
    with LocalNode(tmp_path / "seed", model="none") as node, NodeClient(node.address) as client:
        client.stage(adapters["alpha"], "alpha")
        assert client.manifest("alpha").adapter_id == "alpha"
        with pytest.raises(AdaptersUnsupported, match="store-only"):
            client.promote("alpha")


def test_killed_peer_fails_over_to_a_second_holder(tmp_path, adapters) -> None:
    seed = LocalNode(tmp_path / "seed", model="none", port=free_port(), extra_args=SMALL_CHUNK).start()
    spare = LocalNode(tmp_path / "spare", model="none", port=free_port(), extra_args=SMALL_CHUNK).start()
    puller = LocalNode(tmp_path / "puller", port=free_port(), peers=[spare.address]).start()
    relay = GatedRelay(seed.address, hold_after=2)  # the peer that dies mid-transfer, after exactly two chunks
    try:
        for node in (seed, spare):
            with NodeClient(node.address) as client:
                client.stage(adapters["big"], "big")
        with NodeClient(puller.address) as client, ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(client.promote, "big", peer=relay.address)
            relay.wait_holding()
            relay.kill()
            reply = pulling.result()
            assert reply.source_peer.split(",") == [relay.address, spare.address]
            got = torch.tensor(client.generate(PROMPT, "big", return_logits=True).last_logits)
        assert (got - reference_logits(adapters["big"])).abs().max().item() < 1e-5
    finally:
        relay.kill()
        for node in (seed, spare, puller):
            node.stop()


def test_killed_only_peer_gives_unavailable_then_resumes(tmp_path, adapters) -> None:
    seeder = LocalNode(tmp_path / "seed", model="none", port=free_port(), extra_args=SMALL_CHUNK).start()
    puller = LocalNode(tmp_path / "puller", port=free_port()).start()
    relay = GatedRelay(seeder.address, hold_after=2)  # the only peer: it dies after exactly two chunks
    size = weights_size(adapters["big"])
    try:
        with NodeClient(seeder.address) as client:
            client.stage(adapters["big"], "big")
        with NodeClient(puller.address) as client, ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(client.promote, "big", peer=relay.address)
            relay.wait_holding()
            relay.kill()
            with pytest.raises(PeerUnavailable, match="kept for resume"):
                pulling.result()
            # The bytes are still to be had from the seeder itself.
            reply = client.promote("big", peer=seeder.address)
        assert 0 < reply.bytes_transferred < size, "the second promote must resume, not start over"
    finally:
        relay.kill()
        seeder.stop()
        puller.stop()


def test_invariant_7_generate_keeps_answering_while_a_pull_runs(tmp_path, adapters) -> None:
    """No network I/O under the model lock: a pull held mid-transfer never blocks the resident adapters."""
    seeder = LocalNode(tmp_path / "seed", model="none", port=free_port(), extra_args=SMALL_CHUNK).start()
    puller = LocalNode(tmp_path / "puller", port=free_port(), extra_args=["--stall-timeout", "120"]).start()
    relay = GatedRelay(seeder.address, hold_after=2)
    try:
        with NodeClient(seeder.address) as seed_client:
            seed_client.stage(adapters["big"], "big")
        with NodeClient(puller.address) as client:
            client.stage(adapters["alpha"], "alpha")
            client.promote("alpha", name="alpha")
            with ThreadPoolExecutor(1) as pool:
                pulling = pool.submit(client.promote, "big", peer=relay.address, name="big")
                relay.wait_holding()  # the pull is in progress, and stays so until go()
                for _ in range(5):
                    client.generate(PROMPT, "alpha", max_new_tokens=2)
                assert not pulling.done(), "the pull ended while held"
                relay.go()
                assert pulling.result().digest
    finally:
        relay.kill()
        seeder.stop()
        puller.stop()


def test_a_files_sha256_is_there_for_who_asks_and_only_then(cluster, clients, adapters) -> None:
    """sha256 is off every transfer's path (digest scheme 2), but a person comparing with a hub's listing can ask for it."""
    import hashlib

    a = clients[0]
    a.stage(adapters["alpha"], "sha/alpha")
    assert dict(a.manifest_proto("sha/alpha").file_sha256) == {}
    answered = dict(a.manifest_proto("sha/alpha", with_sha256=True).file_sha256)
    assert answered == {name: hashlib.sha256((adapters["alpha"] / name).read_bytes()).hexdigest()
                        for name in ("adapter_config.json", "adapter_model.safetensors")}
    out = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "inspect", cluster.nodes[0].address, "--id", "sha/alpha", "--sha256", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert {f["name"]: f["sha256"] for f in json.loads(out.stdout)["files"]} == answered
