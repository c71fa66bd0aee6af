"""Issue 21's per-tenant quotas with real node processes: a node started with --policy FILE holding [[quota]] tables.

A stage and a pull past a tenant's bytes or its count are refused before any
byte arrives (no upload or partial is written), naming the prefix, its limit
and usage; other tenants are unaffected; the store-wide limit still applies,
and a tenant past its quota never makes an evicting store drop anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc import security
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.stage_stream import Stream, wait_offset
from tests.support.store import stage_begin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHAPE = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
SEEDED = ("team-a/p1", "team-a/p2", "team-a/p3", "team-b/p1", "team-b/p2", "team-b/p3", "team-c/p1")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Adapter directories of one shape, and a seeder holding SEEDED (no quotas) to pull from."""
    root, base = tmp_path_factory.mktemp("tenants"), build_tiny_model()
    dirs = [make_peft_adapter(root / f"d{i}", base_model=base, seed=90 + i, **SHAPE) for i in range(len(SEEDED))]
    seeder = LocalNode(root / "seeder", model="none").start()
    try:
        with seeder.client() as c:
            for adapter_id, directory in zip(SEEDED, dirs):
                c.stage(directory, adapter_id)
        config = (dirs[0] / "adapter_config.json").stat().st_size
        weights = (dirs[0] / "adapter_model.safetensors").stat().st_size
        yield {"dirs": dirs, "seeder": seeder, "config": config, "weights": weights}
    finally:
        seeder.stop()


def policy(path: Path, world: dict) -> Path:
    """team-a/ may hold two adapters' bytes (their config once), team-b/ two ids; team-c/ is not limited."""
    limit = world["config"] + world["weights"] * 2 + world["weights"] // 2
    path.write_text(
        f"""
[[principal]]
name = "ops"
token_sha256 = "{token_sha256('ops')}"
grants = [{{ verbs = ["admin"], prefixes = ["*"] }}]

[[quota]]
prefix = "team-a/"
max_bytes = {limit}

[[quota]]
prefix = "team-b/"
max_adapters = 2
"""
    )
    return path


def quota_node(tmp_path: Path, world: dict, *extra: str) -> LocalNode:
    """A node under the policy; its client() sends the "ops" principal's token (a policy node needs a principal on every call)."""
    token_file = tmp_path / "ops.token"
    token_file.write_text("ops")
    return LocalNode(
        tmp_path / "q",
        model="none",
        peers=[world["seeder"].address],
        token_file=token_file,
        extra_args=["--policy", str(policy(tmp_path / "policy.toml", world)), *extra],
    ).start()


def nothing_written(node: LocalNode) -> None:
    """No upload, partial download or temp file in the node's store: the refusal came before any byte."""
    left = [p for d in ("uploads", "partial", "tmp") for p in (node.store / d).iterdir()]
    assert left == [], left


def staged(client) -> list[str]:
    return sorted(a.adapter_id for a in client.list().staged)


def begin_only(node: LocalNode, directory: Path, adapter_id: str) -> grpc.RpcError:
    """A Stage stream that sends its StageBegin and no byte of data: the refusal must come from the begin alone."""
    with grpc.insecure_channel(node.address) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            begin = fabric_pb2.StageRequest(begin=stage_begin(directory, adapter_id))
            stub.Stage(iter([begin]), timeout=60, metadata=(("authorization", "Bearer ops"),))
    return caught.value


def test_a_stage_past_a_tenants_bytes_is_refused_before_bytes_arrive(tmp_path, world) -> None:
    dirs = world["dirs"]
    node = quota_node(tmp_path, world)
    try:
        with node.client() as c:
            c.stage(dirs[0], "team-a/one")
            c.stage(dirs[1], "team-a/two")
            error = begin_only(node, dirs[2], "team-a/three")
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 'team-a/'" in error.details() and "nothing was written" in error.details(), error.details()
            nothing_written(node)
            with pytest.raises(QuotaExceeded) as caught:
                c.stage(dirs[2], "TEAM-A/three")  # the client's own path, and case cannot cross the prefix
            held = world["config"] + world["weights"] * 2
            assert f"tenant 'team-a/' is at its limit" in str(caught.value) and f"it holds {held}" in str(caught.value), caught.value
            nothing_written(node)
            c.stage(dirs[2], "team-c/three")  # other tenants are unaffected
            c.stage(dirs[3], "team-b/three")
            assert staged(c) == ["team-a/one", "team-a/two", "team-b/three", "team-c/three"]
            tenants = {t.prefix: t for t in c.store_status().tenants}
            assert (tenants["team-a/"].bytes, tenants["team-a/"].adapters) == (held, 2)
            assert (tenants["team-b/"].adapters, tenants["team-b/"].max_adapters) == (1, 2)
        text = subprocess.run(
            [sys.executable, "-m", "adapter_fabric.cli", "store-status", node.address],
            capture_output=True, text=True, timeout=60, env={**os.environ, "FABRIC_AUTH_TOKEN": "ops"},
        )
        assert text.returncode == 0 and "tenant   team-b/" in text.stdout and "1 of 2 adapters" in text.stdout, text.stdout + text.stderr
    finally:
        node.stop()


def test_a_stage_past_a_tenants_count_is_refused_and_a_new_version_of_a_held_id_is_not(tmp_path, world) -> None:
    dirs = world["dirs"]
    node = quota_node(tmp_path, world)
    try:
        with node.client() as c:
            c.stage(dirs[0], "team-b/one")
            c.stage(dirs[1], "team-b/two")
            error = begin_only(node, dirs[2], "team-b/three")
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 'team-b/' is at its limit of 2 adapters (it holds 2)" in error.details(), error.details()
            nothing_written(node)
            c.stage(dirs[2], "team-b/two")  # the same id, new bytes: still two ids
            assert staged(c) == ["team-b/one", "team-b/two"]
    finally:
        node.stop()


def test_a_pull_past_a_tenants_bytes_or_count_is_refused_before_bytes_arrive(tmp_path, world) -> None:
    peer = world["seeder"].address
    node = quota_node(tmp_path, world)
    try:
        with node.client() as c:
            c.pull("team-a/p1", peer=peer)
            c.pull("team-a/p2", peer=peer)
            with pytest.raises(QuotaExceeded, match="downloading 'team-a/p3': tenant 'team-a/' is at its limit"):
                c.pull("team-a/p3", peer=peer)
            nothing_written(node)
            c.pull("team-b/p1", peer=peer)
            c.pull("team-b/p2", peer=peer)
            with pytest.raises(QuotaExceeded, match="tenant 'team-b/' is at its limit of 2 adapters"):
                c.pull("team-b/p3", peer=peer)
            nothing_written(node)
            c.pull("team-c/p1", peer=peer)  # no quota
            assert staged(c) == ["team-a/p1", "team-a/p2", "team-b/p1", "team-b/p2", "team-c/p1"]
            assert c.store_status().evictions == 0
    finally:
        node.stop()


def test_a_tenant_past_its_quota_evicts_nothing_and_the_store_wide_limit_still_applies(tmp_path, world) -> None:
    """An evicting store at its limit: team-a/ past its own quota is refused, and no adapter goes for it; team-b/,
    within its quota, still meets the store's limit (here: the store evicts its least recently used adapter)."""
    peer, weights = world["seeder"].address, world["weights"]
    node = quota_node(tmp_path, world, "--max-store-bytes", str(world["config"] + weights * 3 + weights // 2))
    try:
        with node.client() as c:
            for adapter_id in ("team-c/p1", "team-a/p1", "team-a/p2"):
                c.pull(adapter_id, peer=peer)
            with pytest.raises(QuotaExceeded, match="tenant 'team-a/'"):
                c.pull("team-a/p3", peer=peer)  # the store alone would have evicted team-c/p1 (the seeder holds it)
            assert staged(c) == ["team-a/p1", "team-a/p2", "team-c/p1"] and c.store_status().evictions == 0
            c.pull("team-b/p1", peer=peer)
            status = c.store_status()
            assert staged(c) == ["team-a/p1", "team-a/p2", "team-b/p1"] and status.evictions == 1
            assert status.used_bytes <= status.quota_bytes
    finally:
        node.stop()


def test_the_store_wide_limit_refuses_a_tenant_within_its_quota(tmp_path, world) -> None:
    dirs, weights = world["dirs"], world["weights"]
    node = quota_node(tmp_path, world, "--max-store-bytes", str(world["config"] + weights + weights // 2), "--when-full", "refuse")
    try:
        with node.client() as c:
            c.stage(dirs[0], "team-b/one")
            with pytest.raises(QuotaExceeded, match="the store holds"):
                c.stage(dirs[1], "team-b/two")
            nothing_written(node)
            assert [t.adapters for t in c.store_status().tenants] == [0, 1]  # the refused upload's reservation was released
    finally:
        node.stop()


def test_a_broken_quota_stops_the_node_at_start_in_one_line(tmp_path, world) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(policy(tmp_path / "p.toml", world).read_text() + '\n[[quota]]\nprefix = "team-d/"\nmax_bytes = "lots"\n')
    result = subprocess.run(
        [sys.executable, "-m", "adapter_fabric.node.main", "--store", str(tmp_path / "s"), "--model", "none", "--listen", "127.0.0.1:0", "--policy", str(bad)],
        capture_output=True, text=True, timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "--policy" in lines[0] and "quota 'team-d/'" in lines[0] and "max_bytes 'lots'" in lines[0], lines[0]


def test_uploads_a_tenant_cut_short_count_against_it_and_never_make_the_store_evict_another(tmp_path, world) -> None:
    """Issue 28 (4): two Stage streams of team-a cut short leave most of their bytes to resume. They count against team-a
    (its StoreStatus line shows them) until they expire, so its next Stage, which fits its quota only if they did not
    count, is refused, and the evicting store, near its limit, drops none of team-c's adapters for it."""
    dirs, weights, config = world["dirs"], world["weights"], world["config"]
    node = quota_node(tmp_path, world, "--max-store-bytes", str(config + weights * 4), "--when-full", "evict")
    try:
        with node.client() as c:
            c.stage(dirs[3], "team-c/one")  # another tenant's cold adapters (the seeder holds copies: evictable)
            c.stage(dirs[4], "team-c/two")
            stub = fabric_pb2_grpc.FabricStub(security.channel(node.address, token="ops"))
            for i in (0, 1):
                data, cfg = (dirs[i] / "adapter_model.safetensors").read_bytes(), (dirs[i] / "adapter_config.json").read_bytes()
                stream = Stream(stub)
                stream.begin(f"team-a/cut-{i}", cfg, data)
                stream.data(0, data[:-1024])
                wait_offset(stub, f"team-a/cut-{i}", data, len(data) - 1024)
                stream.crash()
            try:
                c.stage(dirs[2], "team-a/new")
                refusal = None
            except QuotaExceeded as exc:
                refusal = str(exc)
            assert staged(c) == ["team-c/one", "team-c/two"] and c.store_status().evictions == 0
            assert refusal is not None and "tenant 'team-a/'" in refusal and "in uploads and partial downloads it left" in refusal
            [team_a] = [t for t in c.store_status().tenants if t.prefix == "team-a/"]
            assert team_a.bytes >= 2 * (weights - 1024) and team_a.adapters == 0
    finally:
        node.stop()
