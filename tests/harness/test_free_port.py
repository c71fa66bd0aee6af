"""free_port draws ports the kernel never hands out by itself, so a node's own port-0 bind cannot take one first."""

from __future__ import annotations

import socket

from adapter_fabric.harness import cluster
from adapter_fabric.harness.cluster import LocalNode, free_port


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
