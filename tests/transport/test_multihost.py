"""Multi-host: nodes in network namespaces joined by a bridge, links limited with tc (root only).

A small version of scripts/bench_swarm.py (its adapter from adapter_fabric.harness.bench): 4 store-only nodes, a 4 MiB adapter
on the seed, a swarm rollout to the other three, then the star baseline. The
figures are the benchmark's business; here every node must end with the
seed's digest, through real links with real limits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from adapter_fabric.harness import netlab
from adapter_fabric.harness.bench import make_adapter

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

OK, WHY = netlab.available()


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_swarm_rollout_over_namespaces(tmp_path) -> None:
    adapter = make_adapter(tmp_path / "adapter", size_mib=4)
    prefix = f"fswt{os.getpid() % 100000}"  # per run: two checkouts testing at once must not share namespaces
    lab = netlab.NetLab(prefix, nodes=4, rate_mbit=100, subnet="10.204.0")
    try:
        lab.up()
        command = [
            *lab.exec_prefix(lab.ctl), sys.executable, str(ROOT / "scripts" / "bench_swarm.py"), "--inner",
            "--prefix", prefix, "--count", "4", "--rate-mbit", "100", "--chunk-kib", "256",
            "--adapter", str(adapter), "--work", str(tmp_path / "nodes"), "--subnet", "10.204.0",
        ]  # fmt: skip
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    finally:
        lab.down()
    assert out.returncode == 0, f"see node logs under {tmp_path / 'nodes'}"
    report = json.loads(out.stdout)
    assert report["size"] == (adapter / "adapter_model.safetensors").stat().st_size
    assert [row["mode"] for row in report["rows"]] == ["single", "swarm", "star"]
    assert [row["nodes"] for row in report["rows"]] == [1, 3, 3]
    assert all(row["digest_ok"] for row in report["rows"])
    assert not set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) & set(lab.namespaces())


def _swarm_ideal():
    spec = importlib.util.spec_from_file_location("swarm_ideal", ROOT / "scripts" / "swarm_ideal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
@pytest.mark.parametrize("topology", ["chain", "tree2"])
def test_the_physical_limits_forwarders_deliver_every_byte_over_jumbo_frames(tmp_path, topology) -> None:
    """bench_swarm --ideal's forwarders (one per namespace, splice in, sendfile on) give every receiver the seed's bytes."""
    swarm_ideal = _swarm_ideal()
    source = tmp_path / "blob"
    source.write_bytes(os.urandom((4 << 20) + 12345))  # not a multiple of the pipe or the low mark
    prefix = f"fswi{os.getpid() % 100000}"
    lab = netlab.NetLab(prefix, nodes=5, rate_mbit=100, subnet="10.205.0", mtu=9000)
    try:
        lab.up()
        mtus = [subprocess.run(["ip", "-n", lab.node_ns(i), "-o", "link", "show", "eth0"], capture_output=True, text=True).stdout for i in range(5)]
        row = swarm_ideal.run(lab, 4, topology, source, tmp_path / "ideal")
    finally:
        lab.down()
    assert all(" mtu 9000 " in line for line in mtus)
    assert row["mode"] == f"ideal {topology}" and row["nodes"] == 4 and row["size"] == source.stat().st_size
    assert row["intact"]
    assert 0 < row["fastest_s"] <= row["slowest_s"]
    # the links' counters, read while the forwarders still hold their namespaces: every byte crossed two tbf qdiscs per hop
    assert row["net"]["qdisc_packets"] >= 2 * 4 * row["size"] // 65536
    assert row["net"]["tcp_out"] >= 4 * row["size"] // 65536
    assert {"tcp_retrans", "tcp_loss_probes", "tcp_dsack_recv", "tcp_delayed_acks"} <= row["net"].keys()  # read too (each may be 0)
    assert not (tmp_path / "ideal").exists()
    assert not set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) & set(lab.namespaces())
