"""free_port draws ports the kernel never hands out by itself, so a node's own port-0 bind cannot take one first,
and claims each against other processes, so two test workers never draw the same one."""

from __future__ import annotations

import socket
import subprocess
import sys

from adapter_fabric.harness import cluster
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.harness.port_claims import PortClaims


def test_ports_come_from_below_the_ephemeral_range_and_are_not_repeated() -> None:
    floor = cluster._ephemeral_range_floor()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(cluster._RESERVED_FLOOR <= port < floor for port in ports)


def test_a_port_in_use_is_skipped() -> None:
    taken = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        for _ in range(20):
            assert free_port() != taken


def test_a_node_that_cannot_bind_says_why_in_the_error(tmp_path) -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        node = LocalNode(tmp_path / "store", model="none", port=port)
        node.launch()
        try:
            node.wait_ready()
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            message = str(error)
        else:
            node.stop()
            raise AssertionError("the node started on a port already in use")
    assert "before listening" in message and str(port) in message.split("it ends:")[1]


def test_a_port_another_live_process_drew_is_never_drawn_here_and_is_free_once_it_exits(tmp_path, monkeypatch) -> None:
    """Two test workers drawing at once: each port goes to one (``port_claims``); a dead drawer's ports come back."""
    directory = tmp_path / "claims"
    monkeypatch.setattr(cluster, "_claims", PortClaims(directory), raising=False)
    draw = (
        "import sys; from pathlib import Path; from adapter_fabric.harness import cluster; "
        "from adapter_fabric.harness.port_claims import PortClaims; cluster._claims = PortClaims(Path(sys.argv[1])); "
        "print(*[cluster.free_port() for _ in range(20)], flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen([sys.executable, "-c", draw, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        theirs = {int(p) for p in other.stdout.readline().split()}
        assert len(theirs) == 20
        monkeypatch.setattr(cluster, "_next_port", min(theirs) - cluster._RESERVED_FLOOR)  # walk right through their ports
        mine = {free_port() for _ in range(40)}
        assert not mine & theirs
    finally:
        other.communicate("", timeout=60)
    monkeypatch.setattr(cluster, "_next_port", min(theirs) - cluster._RESERVED_FLOOR)
    assert free_port() == min(theirs)  # its drawer exited: the claim is stale, taken over
