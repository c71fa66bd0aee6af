"""The data channel beside gRPC (node/data_server.py, fabric/transport/data_channel.py): real node processes.

Pulls move their bytes on it when the peer offers it, and over gRPC when it
does not or cannot be reached; it guards what gRPC Fetch guards (mTLS, the
token, streams per peer) before a byte leaves; hostile and stalled readers get
a named refusal or are cut, and the node keeps answering; failover and resume
work across it.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from adapter_fabric.errors import FabricError, InvalidArgument, QuotaExceeded, Unauthenticated
from adapter_fabric.harness.bench import make_adapter
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.observability.metrics import DATA_FALLBACKS
from adapter_fabric.rpc.status import error_from_detail
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.transport import data_frames, fetch_metadata
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.v1 import fabric_pb2
from tests.support.certs import TestCA
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

METRICS = ["--metrics-listen", "127.0.0.1:0"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data-channel")
    return make_peft_adapter(root / "a", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=5)


@pytest.fixture(scope="module")
def big_adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("data-channel-big") / "big", size_mib=4, hidden=1024, rank=16)


def store_node(root: Path, name: str, *extra: str, peers: tuple[str, ...] = (), port: int = 0, **kwargs) -> LocalNode:
    return LocalNode(root / name, model="none", port=port or free_port(), peers=peers, extra_args=["--chunk-size", "4096", *METRICS, *extra], **kwargs)


def data_port(node: LocalNode) -> int:
    marker = "data channel on port "
    return int(node.banner[node.banner.index(marker) + len(marker):].split(",")[0].split(")")[0])


def counter(node: LocalNode, name: str, **labels: str) -> float:
    return scrape(node).get((name, frozenset(labels.items())), 0.0)


def hello(digest: str, *, token: str = "", offset: int = 0, length: int = 0, file: str = "") -> bytes:
    request = fabric_pb2.FetchRequest(digest=digest, file=file, offset=offset, length=length)
    return data_frames.encode_hello(fabric_pb2.DataHello(token=token, fetch=request))


def exchange(port: int, payload: bytes, *, tls: ssl.SSLContext | None = None) -> list[tuple[int, int, bytes]]:
    """Send ``payload`` on a fresh connection and read every frame until the node closes it: ``(kind, offset, payload)``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
    with sock:
        sock.sendall(payload)
        data = bytearray()
        while chunk := sock.recv(1 << 16):
            data += chunk
    frames, pos = [], 0
    while pos + data_frames.FRAME.size <= len(data):
        kind, offset, length = data_frames.parse_frame_header(bytes(data[pos:pos + data_frames.FRAME.size]))
        pos += data_frames.FRAME.size
        frames.append((kind, offset, bytes(data[pos:pos + length])))
        pos += length
    return frames


def refusal(frames: list[tuple[int, int, bytes]]) -> FabricError:
    """The error a stream of frames ended with; fails when any chunk was sent."""
    assert [kind for kind, _, _ in frames] == [data_frames.ERROR], frames
    error = error_from_detail(frames[0][2])
    assert error is not None
    return error


# ---------------------------------------------------------------- which channel carries a pull


def test_a_pull_moves_its_bytes_over_the_data_channel(tmp_path, adapter) -> None:
    seed, puller = store_node(tmp_path, "seed").start(), None
    try:
        puller = store_node(tmp_path, "puller", peers=(seed.address,)).start()
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        with puller.client() as client:
            assert client.pull("team/a", peer=seed.address).digest == digest
        assert counter(puller, "fabric_fetch_streams_total", channel="data") >= 1
        # Over gRPC only where the data channel to the killed seed broke before its first frame: a fallback, counted as such.
        fallbacks = sum(counter(puller, "fabric_data_channel_fallbacks_total", reason=r) for r in ("busy", "broken"))
        assert counter(puller, "fabric_fetch_streams_total", channel="grpc") <= fallbacks
        assert counter(seed, "fabric_data_channel_streams_total", outcome="ok") >= 1
        assert counter(puller, "fabric_data_channel_fallbacks_total", reason="connect") == 0
    finally:
        for node in (puller, seed):
            if node is not None:
                node.stop()


def test_a_peer_without_the_channel_is_fetched_over_grpc(tmp_path, adapter) -> None:
    seed, puller = store_node(tmp_path, "seed", "--data-port", "off").start(), None
    try:
        assert "no data channel" in seed.banner
        puller = store_node(tmp_path, "puller").start()
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        with puller.client() as client:
            assert client.pull("team/a", peer=seed.address).digest == digest
        assert counter(puller, "fabric_fetch_streams_total", channel="grpc") >= 1
        assert counter(puller, "fabric_fetch_streams_total", channel="data") == 0
    finally:
        for node in (puller, seed):
            if node is not None:
                node.stop()


def test_an_announced_port_that_cannot_be_reached_falls_back_for_a_while() -> None:
    """A port announced but closed (a firewall that rejects, a node gone): no call to use; counted; not retried at once."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    channels = DataChannels()
    peer = "127.0.0.1:1"
    channels.learn(peer, fetch_metadata.announce_data_port(closed))
    assert channels.port(peer) == closed
    before = DATA_FALLBACKS.labels("connect")._value.get()
    assert channels.open(peer, fabric_pb2.FetchRequest(digest="d"), None, 4096) is None
    assert DATA_FALLBACKS.labels("connect")._value.get() == before + 1
    assert channels.port(peer) is None  # gRPC for RETRY_AFTER_S
    channels.learn(peer, ())  # a reply that announces nothing: the peer has no channel
    assert channels.port(peer) is None


def test_a_bad_data_port_setting_is_refused_by_name(tmp_path) -> None:
    node = store_node(tmp_path, "bad", "--data-port", "70000")
    with pytest.raises(FabricError):
        node.start()
    assert "--data-port" in node.log_path.read_text() and "65535" in node.log_path.read_text()


# ---------------------------------------------------------------- the same trust as gRPC


def test_mtls_and_token_guard_the_channel_before_any_byte(tmp_path, adapter) -> None:
    ca = TestCA(tmp_path / "pki")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    seed = store_node(tmp_path, "seed", "--auth-peer-reads", tls=ca.issue("seed"), token_file=token_file).start()
    puller = None
    try:
        # the seed is its member (--peers): the puller's certificate and token go to members only (transport.membership)
        puller = store_node(tmp_path, "puller", tls=ca.issue("puller"), token_file=token_file, peers=(seed.address,)).start()
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        with puller.client() as client:
            assert client.pull("team/a", peer=seed.address).digest == digest
        assert counter(puller, "fabric_fetch_streams_total", channel="data") >= 1  # under mTLS and the token

        port = data_port(seed)
        # No TLS at all: the node speaks TLS only; nothing but a handshake failure comes back.
        assert exchange(port, hello(digest)) == []
        # TLS without a client certificate: the handshake is refused (mutual TLS).
        anonymous = ssl.create_default_context(cafile=str(ca.cert_path))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            frames = exchange(port, hello(digest), tls=anonymous)
            assert frames == []  # TLS 1.3 may report the refusal as an empty stream instead
            raise ConnectionError("refused after the handshake")
        # A client certificate but no (or a wrong) token: refused by name, no chunk sent.
        other = ca.issue("stranger")
        with_cert = ssl.create_default_context(cafile=str(ca.cert_path))
        with_cert.load_cert_chain(other.cert, other.key)
        for token in ("", "wrong-token"):
            error = refusal(exchange(port, hello(digest, token=token), tls=with_cert))
            assert isinstance(error, Unauthenticated) and "token" in str(error)
        assert [k for k, _, _ in exchange(port, hello(digest, token="s3cret-token"), tls=with_cert)][-1] == data_frames.END
    finally:
        for node in (puller, seed):
            if node is not None:
                node.stop()


def test_a_hello_under_way_when_the_node_begins_draining_hears_why(tmp_path, adapter) -> None:
    """The node gets SIGTERM with no stream open, while a puller's hello is half sent: the rest of it is still read,
    within --drain-timeout, and answered with the drain's refusal (before, the connection was closed without a word,
    and the puller reported the closed port it then met on gRPC)."""
    import signal

    node = store_node(tmp_path, "seed", "--drain-timeout", "5").start()
    try:
        with node.client() as c:
            digest = c.stage(adapter, "a").digest
        port = data_port(node)
        payload = hello(digest)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(payload[:3])
            time.sleep(0.2)  # the node has the first bytes: the hello is under way
            node.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # draining by now, with nothing else open
            sock.sendall(payload[3:])
            data = bytearray()
            while chunk := sock.recv(1 << 16):
                data += chunk
        assert len(data) >= data_frames.FRAME.size, "the draining node closed the connection without a frame"
        kind, _, length = data_frames.parse_frame_header(bytes(data[: data_frames.FRAME.size]))
        error = error_from_detail(bytes(data[data_frames.FRAME.size : data_frames.FRAME.size + length]))
        assert kind == data_frames.ERROR and error is not None, bytes(data[:200])
        assert "shutting down" in str(error) and "--drain-timeout" in str(error), error
        assert node.process.wait(30) == 0
    finally:
        node.stop()


# ---------------------------------------------------------------- hostile and stalled readers


def test_hostile_requests_get_named_refusals_and_the_node_keeps_answering(tmp_path, adapter) -> None:
    seed = store_node(tmp_path, "seed").start()
    try:
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        port = data_port(seed)
        cases = {
            "garbage framing": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            "absurd hello length": data_frames.HELLO_PREFIX.pack(data_frames.MAGIC, 0xFFFFFFFF),
            "hello that is no DataHello": data_frames.HELLO_PREFIX.pack(data_frames.MAGIC, 4) + b"\xff\xff\xff\xff",
            "truncated hello": data_frames.HELLO_PREFIX.pack(data_frames.MAGIC, 100) + b"\x0a\x02",
        }
        for what, payload in cases.items():
            frames = exchange(port, payload) if what != "truncated hello" else _half_closed(port, payload)
            assert isinstance(refusal(frames), InvalidArgument), what
        absurd = {
            "offset past the end": hello(digest, offset=1 << 40),
            "offset off a chunk boundary": hello(digest, offset=3),
            "length far past the end": hello(digest, length=(1 << 64) - 1),
            "unknown digest": hello("0" * 64),
            "unknown file": hello(digest, file="nope.bin"),
        }
        for what, payload in absurd.items():
            frames = exchange(port, payload)
            if what == "length far past the end":  # clamped to the file, as gRPC Fetch does
                assert frames[-1][0] == data_frames.END, what
                continue
            error = refusal(frames)
            assert str(error) and str(tmp_path) not in str(error), (what, error)  # named, without the node's paths
        with seed.client() as client:
            assert client.manifest("team/a").digest == digest  # still answering
    finally:
        seed.stop()


def _half_closed(port: int, payload: bytes) -> list[tuple[int, int, bytes]]:
    """Send ``payload`` and shut the write side, as a peer that gives up mid-hello does."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = bytearray()
        while chunk := sock.recv(1 << 16):
            data += chunk
    kind, offset, length = data_frames.parse_frame_header(bytes(data[: data_frames.FRAME.size]))
    return [(kind, offset, bytes(data[data_frames.FRAME.size:data_frames.FRAME.size + length]))]


def test_a_reader_that_stops_reading_is_cut_and_frees_its_stream(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed", "--stall-timeout", "1", "--max-streams-per-peer", "1").start()
    try:
        with seed.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        port = data_port(seed)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(hello(digest))
        # The one stream this host may hold is the stalled one: a second is refused as busy, by name...
        assert isinstance(refusal(exchange(port, hello(digest))), QuotaExceeded)
        # ... until the node cuts the reader that takes nothing (--stall-timeout plus a chunk at 64 KiB/s).
        deadline = time.monotonic() + 30
        while True:
            frames = exchange(port, hello(digest))
            if frames and frames[-1][0] == data_frames.END:
                break
            assert time.monotonic() < deadline, "the stalled reader was never cut"
            time.sleep(0.5)
        stalled.settimeout(10)
        received = 0
        try:
            while chunk := stalled.recv(1 << 16):
                received += len(chunk)
        except ConnectionError:
            pass
        stalled.close()
        assert received < (big_adapter / "adapter_model.safetensors").stat().st_size  # cut, not finished
        assert counter(seed, "fabric_data_channel_streams_total", outcome="broken") >= 1
    finally:
        seed.stop()


# ---------------------------------------------------------------- failover, resume and swarm across the channel


def test_failover_and_resume_across_the_channel(tmp_path, big_adapter) -> None:
    size = (big_adapter / "adapter_model.safetensors").stat().st_size
    slow = ["--upload-rate", str(1 << 20)]  # 4 MiB take seconds: time to kill mid-pull
    first, second, puller = store_node(tmp_path, "first", *slow).start(), store_node(tmp_path, "second", *slow).start(), None
    try:
        with first.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        with second.client() as client:
            client.pull("team/big", peer=first.address)
        puller = store_node(tmp_path, "puller", peers=(first.address, second.address)).start()
        outcome: dict = {}
        thread = threading.Thread(target=_pull, args=(puller, first.address, outcome), daemon=True)
        thread.start()
        _wait_until_served(first, more_than=_served(first))
        first.kill()  # kill -9 mid-pull: the rest comes from the second seed
        thread.join(120)
        assert outcome.get("result") is not None and outcome["result"].digest == digest, outcome
        assert counter(puller, "fabric_pull_failovers_total") >= 1 or outcome["result"].source_peers == [second.address]
        assert counter(puller, "fabric_fetch_streams_total", channel="data") >= 2
        # Over gRPC only where the data channel to the killed seed broke before its first frame, or refused the connect of a
        # request started as it died: a fallback, counted as such.
        fallbacks = sum(counter(puller, "fabric_data_channel_fallbacks_total", reason=r) for r in ("busy", "broken", "connect"))
        assert counter(puller, "fabric_fetch_streams_total", channel="grpc") <= fallbacks

        # Resume: the puller itself killed mid-pull keeps its verified chunks, and the rerun asks only for the rest.
        with puller.client() as client:
            client.unstage("team/big")
        thread = threading.Thread(target=_pull, args=(puller, second.address, {}), daemon=True)
        thread.start()
        _wait_until_served(second, more_than=_served(second) + 64 * 1024)
        puller.kill()
        puller = store_node(tmp_path, "puller", peers=(second.address,)).start()
        outcome = {}
        _pull(puller, second.address, outcome)
        assert outcome.get("result") is not None and outcome["result"].digest == digest, outcome
        assert outcome["result"].bytes_transferred < size  # what the killed pull verified was kept
        assert counter(puller, "fabric_fetch_streams_total", channel="data") >= 1
    finally:
        for node in (puller, second, first):
            if node is not None:
                node.kill()


def _pull(node: LocalNode, peer: str, outcome: dict) -> None:
    try:
        with node.client() as client:
            outcome["result"] = client.pull("team/big", peer=peer)
    except FabricError as exc:
        outcome["error"] = exc


def _served(node: LocalNode) -> float:
    return counter(node, "fabric_served_bytes_total")


def _wait_until_served(node: LocalNode, more_than: float) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _served(node) > more_than:
            return
        time.sleep(0.02)
    raise AssertionError("the pull received nothing")


def test_a_swarm_rollout_moves_its_bytes_over_the_channel(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed").start()
    nodes: list[LocalNode] = []
    try:
        with seed.client() as client:
            digest = client.stage(big_adapter, "team/big").digest
        ports = [free_port() for _ in range(3)]
        everyone = [seed.address, *(f"127.0.0.1:{p}" for p in ports)]
        nodes = [store_node(tmp_path, f"n{i}", peers=tuple(a for a in everyone if not a.endswith(f":{p}")), port=p) for i, p in enumerate(ports)]
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
        outcomes = [{} for _ in nodes]
        threads = [threading.Thread(target=_pull_from, args=(n, everyone, o)) for n, o in zip(nodes, outcomes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [o.get("digest") for o in outcomes] == [digest] * 3, outcomes
        # A peer first met through a hint on a Fetch (not a GetManifest or Availability reply) has not announced its
        # channel yet: that first stream to it goes over gRPC, and its trailer announces the channel for the next.
        data = sum(counter(node, "fabric_fetch_streams_total", channel="data") for node in nodes)
        grpc_streams = sum(counter(node, "fabric_fetch_streams_total", channel="grpc") for node in nodes)
        assert all(counter(node, "fabric_fetch_streams_total", channel="data") >= 1 for node in nodes)
        assert data > grpc_streams, (data, grpc_streams)
    finally:
        for node in (*nodes, seed):
            node.stop()


def _pull_from(node: LocalNode, peers: list[str], outcome: dict) -> None:
    try:
        with node.client() as client:
            outcome["digest"] = client.pull("team/big", peer=peers[0]).digest
    except FabricError as exc:
        outcome["error"] = exc
