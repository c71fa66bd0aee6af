"""Issue 29, items 5, 6 and 10 (drain): the data channel under floods of idle connections, plain and TLS, at a low
open-files limit, and drained with streams in flight; real node processes, raw sockets from another loopback address
(``tests/support/flood.py``).

Connections are counted from their accept (TLS included, before the handshake ends), bounded per source address
(``MAX_CONNECTIONS_PER_SOURCE``) and in all (``MAX_CONNECTIONS``, at most a quarter of the open-files limit), idle ones
shed first; a stream refused as busy goes over gRPC at once.
"""

from __future__ import annotations

import resource
import signal
import socket
import threading

import pytest

from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.node.data_server import MAX_CONNECTIONS
from tests.node.test_hostile_weak_spots import wait_for
from tests.support.certs import TestCA
from tests.support.flood import Flood
from tests.transport.test_data_channel import big_adapter, counter, data_port, hello, store_node  # noqa: F401 (big_adapter: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: an honest pull of 4 MiB completes within this under the flood (was: refused busy, then stalled, or the deadline)
PULL_DEADLINE_S = 60.0


def rss_mib(node: LocalNode) -> float:
    with open(f"/proc/{node.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_an_honest_pull_completes_under_a_flood_of_idle_connections(tmp_path, big_adapter) -> None:
    seed, puller = store_node(tmp_path, "seed").start(), None
    try:
        with seed.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        puller = store_node(tmp_path, "puller", peers=(seed.address,)).start()
        with Flood(data_port(seed), MAX_CONNECTIONS + 44):  # more than the node holds in all, from one other address
            with puller.client() as client:
                assert client.pull("team/big", peer=seed.address, timeout=PULL_DEADLINE_S).digest == digest
        log = seed.log_path.read_text()
        # the honest peer's streams were never refused (was: thousands of "busy" refusals; the pull limped on its backoffs)
        assert "data channel stream from 127.0.0.1 refused" not in log and "Traceback" not in log
        assert counter(seed, "fabric_data_channel_streams_total", outcome="shed") > 0  # the flood's own idle connections made room
        assert counter(puller, "fabric_fetch_streams_total", channel="data") >= 1
    finally:
        for node in (puller, seed):
            if node is not None:
                node.stop()


def test_silent_tls_connections_are_counted_from_accept_even_at_a_low_open_files_limit(tmp_path, big_adapter) -> None:
    ca = TestCA(tmp_path / "pki")
    seed = store_node(tmp_path, "seed", tls=ca.issue("seed")).start()
    puller = None
    try:
        resource.prlimit(seed.pid, resource.RLIMIT_NOFILE, (1024, 1024))  # as a container's default
        with seed.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        puller = store_node(tmp_path, "puller", peers=(seed.address,), tls=ca.issue("puller")).start()
        before = rss_mib(seed)
        with Flood(data_port(seed), 1100) as flood:  # TCP connections that never start their TLS handshake
            wait_for(lambda: flood.opened >= 1100, "the flood to open its connections")
            with puller.client() as client:
                assert client.pull("team/big", peer=seed.address, timeout=PULL_DEADLINE_S).digest == digest
            grown = rss_mib(seed) - before
        log = seed.log_path.read_text()
        assert "Traceback" not in log and log.count("out of system resource") <= 1, log[-3000:]
        assert grown < 100, f"the seed's memory grew {grown:.0f} MiB under 1,100 silent TLS connections (was ~400)"
    finally:
        for node in (puller, seed):
            if node is not None:
                node.stop()


def test_a_drain_with_an_upload_rate_and_streams_in_flight_logs_no_traceback(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed", "--upload-rate", str(16 << 10), "--drain-timeout", "2").start()
    try:
        with seed.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        streams = [socket.create_connection(("127.0.0.1", data_port(seed)), timeout=60) for _ in range(16)]
        for sock in streams:
            sock.sendall(hello(digest))  # the whole file each: 16 streams share 16 KiB/s, four 4 KiB chunks a second
        readers = [threading.Thread(target=_read_to_end, args=(sock,), daemon=True) for sock in streams]
        for reader in readers:
            reader.start()
        wait_for(lambda: counter(seed, "fabric_served_bytes_total") > 16 << 10, "the streams to send")
        seed.process.send_signal(signal.SIGTERM)  # most streams are waiting on the upload rate when the drain ends
        assert seed.process.wait(60) == 0
        log = seed.log_path.read_text()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
        for sock in streams:
            sock.close()
    finally:
        seed.stop()


def _read_to_end(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
