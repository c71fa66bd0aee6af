"""A puller's requests to one peer share a data channel connection (``DataHello.keep_open``; ``idle_connections``).

A real node serves one connection's requests one after another; a kept connection the node closed meanwhile (it
restarted, it is an older node that closes after END, or it let go just as the next hello went out) is replaced by a
new connection, the request unchanged, never counted as a fallback to gRPC.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from adapter_fabric.harness.cluster import free_port
from adapter_fabric.node.data_server import MAX_CONNECTIONS_PER_SOURCE
from adapter_fabric.observability.metrics import DATA_CONNECTIONS, DATA_FALLBACKS
from adapter_fabric.transport import data_frames, fetch_metadata
from adapter_fabric.transport.chunk_buffers import BufferPool
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.idle_connections import IdleConnections
from adapter_fabric.v1 import fabric_pb2
from tests.support.waiting import wait_for
from tests.transport.test_data_channel import adapter, counter, data_port, store_node  # noqa: F401 (adapter: a module fixture)

WEIGHTS = "adapter_model.safetensors"


def connections(kind: str) -> float:
    return DATA_CONNECTIONS.labels(kind)._value.get()


def fallbacks() -> float:
    return sum(DATA_FALLBACKS.labels(reason)._value.get() for reason in ("connect", "tls", "busy", "broken"))


def fetch(channels: DataChannels, peer: str, request: fabric_pb2.FetchRequest) -> bytes:
    call = channels.open(peer, request, None, 1 << 20)
    assert call is not None
    return b"".join(bytes(data) for _, data in call)


# ---------------------------------------------------------------- a real node


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_requests_to_one_peer_share_a_kept_connection_and_one_the_node_closed_is_replaced(tmp_path, adapter) -> None:
    grpc_port, port = free_port(), free_port()
    seed = store_node(tmp_path, "seed", "--data-port", str(port), port=grpc_port).start()
    try:
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        weights = (Path(adapter) / WEIGHTS).read_bytes()
        channels, peer = DataChannels(), seed.address
        channels.learn(peer, fetch_metadata.announce_data_port(port))
        half = len(weights) // 2 // 4096 * 4096  # a chunk boundary (store_node: 4 KiB chunks)
        requests = [
            fabric_pb2.FetchRequest(digest=digest, file=WEIGHTS),
            fabric_pb2.FetchRequest(digest=digest, file=WEIGHTS, offset=0, length=half),
            fabric_pb2.FetchRequest(digest=digest, file=WEIGHTS, offset=half, length=len(weights) - half),
        ]
        new, kept, fell_back = connections("new"), connections("kept"), fallbacks()
        got = [fetch(channels, peer, request) for request in requests]
        assert got == [weights, weights[:half], weights[half:]]
        assert (connections("new") - new, connections("kept") - kept) == (1, 2)  # three requests, one connection
        assert counter(seed, "fabric_data_channel_streams_total", outcome="ok") == 3

        seed.stop()  # the kept connection is closed under the puller
        seed = store_node(tmp_path, "seed", "--data-port", str(port), port=grpc_port).start()
        assert fetch(channels, peer, requests[0]) == weights
        assert connections("new") - new == 2 and fallbacks() == fell_back  # a new connection, not gRPC
        channels.close()
    finally:
        seed.stop()


def read_stream(sock: socket.socket) -> list[int]:
    """The kinds of one stream's frames, up to its END or ERROR (the connection stays open)."""
    kinds: list[int] = []
    while not kinds or kinds[-1] not in (data_frames.END, data_frames.ERROR):
        header = sock.recv(data_frames.FRAME.size, socket.MSG_WAITALL)
        assert len(header) == data_frames.FRAME.size, "the node closed the connection mid-stream"
        kind, _, length = data_frames.parse_frame_header(header)
        assert len(sock.recv(length, socket.MSG_WAITALL)) == length
        kinds.append(kind)
    return kinds


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_kept_connection_counts_as_idle_between_requests_and_is_shed_first(tmp_path, adapter) -> None:
    seed = store_node(tmp_path, "seed").start()
    others: list[socket.socket] = []
    try:
        with seed.client() as client:
            digest = client.stage(adapter, "team/a").digest
        hello = data_frames.encode_hello(fabric_pb2.DataHello(fetch=fabric_pb2.FetchRequest(digest=digest, file=WEIGHTS), keep_open=True))
        kept = socket.create_connection(("127.0.0.1", data_port(seed)), timeout=30)
        for _ in range(2):  # two requests on one connection
            kept.sendall(hello)
            assert read_stream(kept)[-1] == data_frames.END
        shed = counter(seed, "fabric_data_channel_streams_total", outcome="shed")
        for _ in range(MAX_CONNECTIONS_PER_SOURCE):  # the source's bound: the oldest idle connection makes room
            others.append(socket.create_connection(("127.0.0.1", data_port(seed)), timeout=30))
        assert kept.recv(1) == b""  # shed: it was idle, waiting for a third request
        wait_for(lambda: counter(seed, "fabric_data_channel_streams_total", outcome="shed") > shed, "the kept connection counted as shed", 30)
        kept.close()
    finally:
        for sock in others:
            sock.close()
        seed.stop()


# ---------------------------------------------------------------- raw servers: an older node, a node that lets go late


class Scripted:
    """A TCP server whose connections each follow a script: for every hello it reads, answer (a CHUNK and END) or close."""

    def __init__(self, scripts: list[list[bool]], payload: bytes = b"chunk") -> None:
        self.scripts = scripts  # per connection, in accept order: True = answer the hello, False = close without a word
        self.payload = payload
        self.hellos = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        for script in self.scripts:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                for answer in script:
                    if not self._read_hello(conn):
                        break
                    self.hellos += 1
                    if not answer:
                        break
                    conn.sendall(data_frames.frame_header(data_frames.CHUNK, 0, len(self.payload)) + self.payload)
                    end = data_frames.encode_end(True, None)
                    conn.sendall(data_frames.frame_header(data_frames.END, 0, len(end)) + end)

    @staticmethod
    def _read_hello(conn: socket.socket) -> bool:
        prefix = conn.recv(data_frames.HELLO_PREFIX.size, socket.MSG_WAITALL)
        if len(prefix) < data_frames.HELLO_PREFIX.size:
            return False
        length = data_frames.hello_length(prefix)
        return len(conn.recv(length, socket.MSG_WAITALL)) == length


def channel_to(port: int) -> tuple[DataChannels, str]:
    channels, peer = DataChannels(), "127.0.0.1:1"
    channels.learn(peer, fetch_metadata.announce_data_port(port))
    return channels, peer


REQUEST = fabric_pb2.FetchRequest(digest="ab" * 32, file=WEIGHTS)


def test_a_node_that_closes_after_end_costs_a_new_connection_per_request_and_no_fallback() -> None:
    server = Scripted([[True], [True], [True]])  # an older node: one request per connection
    channels, peer = channel_to(server.port)
    fell_back = fallbacks()
    assert [fetch(channels, peer, REQUEST) for _ in range(3)] == [b"chunk"] * 3
    assert fallbacks() == fell_back and server.hellos == 3


def test_a_kept_connection_closed_as_the_hello_goes_out_is_replaced_once_with_the_same_request() -> None:
    server = Scripted([[True, False], [True]])  # the node lets the kept connection go on reading the second hello
    channels, peer = channel_to(server.port)
    new, kept, fell_back = connections("new"), connections("kept"), fallbacks()
    assert fetch(channels, peer, REQUEST) == b"chunk"
    assert fetch(channels, peer, REQUEST) == b"chunk"
    assert (connections("new") - new, connections("kept") - kept) == (2, 1)
    assert fallbacks() == fell_back and server.hellos == 3  # the second request, sent twice: once per connection


def test_a_kept_connection_is_not_kept_after_a_cancel() -> None:
    server = Scripted([[True, True], [True]])
    channels, peer = channel_to(server.port)
    call = channels.open(peer, REQUEST, None, 1 << 20)
    assert call is not None
    next(iter(call))
    call.cancel()  # the caller left before END: the connection may still carry the rest of the stream
    call.close()
    kept = connections("kept")
    assert fetch(channels, peer, REQUEST) == b"chunk"
    assert connections("kept") == kept


def test_streams_read_one_after_another_receive_into_one_buffer_and_a_cut_stream_keeps_its_own() -> None:
    server = Scripted([[True, True, True], [True]])
    channels, peer = channel_to(server.port)
    buffers = []
    for _ in range(2):  # each stream read to its END gives its buffer back for the next
        call = channels.open(peer, REQUEST, None, 1 << 20)
        assert call is not None
        chunks = [(offset, data) for offset, data in call]
        assert [bytes(data) for _, data in chunks] == [b"chunk"]
        buffers.append(chunks[0][1].obj)
    assert buffers[0] is buffers[1], "a new receive buffer per stream (a zeroed 1 MiB allocation each)"
    call = channels.open(peer, REQUEST, None, 1 << 20)
    assert call is not None
    _, data = next(iter(call))
    call.cancel()  # cut from another thread, as the swarm's watchdog does: the reader may still use its view
    call.close()
    later = channels.open(peer, REQUEST, None, 1 << 20)
    assert later is not None
    assert [bytes(d) for _, d in later] == [b"chunk"]
    assert bytes(data) == b"chunk", "a cut stream's buffer was handed to the next stream"


def test_the_buffer_pool_keeps_idle_buffers_within_its_bound() -> None:
    pool = BufferPool(max_bytes=3 << 10)
    taken = [pool.take(1 << 10) for _ in range(4)]
    for buffer in taken:
        pool.give(buffer)
    assert pool.idle_bytes == 3 << 10  # the fourth was let go
    assert pool.take(1 << 10) in taken and pool.take(2 << 10) not in taken  # only a buffer of the size asked for


# ---------------------------------------------------------------- the pool's bounds


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def test_idle_connections_are_bounded_per_peer_and_in_all_and_let_go_in_time() -> None:
    now = [0.0]
    idle = IdleConnections(per_peer=2, total=3, keep_s=20.0, clock=lambda: now[0])
    mine = [pair() for _ in range(5)]
    for sock, _ in mine[:3]:
        idle.put("a", sock)
    assert len(idle) == 2 and mine[0][0].fileno() < 0  # per peer: the oldest is closed
    idle.put("b", mine[3][0])
    idle.put("c", mine[4][0])
    assert len(idle) == 3 and mine[1][0].fileno() < 0  # in all: the oldest is closed
    assert idle.take("a") is mine[2][0] and idle.take("a") is None
    now[0] = 25.0
    assert idle.take("b") is None and len(idle) == 0  # kept past keep_s: closed, never handed out
    for sock, other in mine:
        sock.close()
        other.close()


def test_an_idle_connection_the_peer_closed_is_never_handed_out() -> None:
    idle = IdleConnections()
    sock, other = pair()
    idle.put("a", sock)
    other.close()
    assert idle.take("a") is None and sock.fileno() < 0
    sock, other = pair()
    idle.put("a", sock)
    other.sendall(b"x")  # a byte between requests: out of step, not used
    assert idle.take("a") is None
    other.close()
