"""A data channel stream's deadlines cost no asyncio task per frame, and its small frames leave at once (node/data_server.py).

The server runs in this process on its own event loop, whose task factory counts every task made; the puller is the
real ``DataChannels`` client on a kept connection. A stand-in for ``PeerReads`` yields a real file's chunks as a
committed blob's (``FilePiece``, then ``Holds``): what is counted is the server's own machinery per frame.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from adapter_fabric.node.data_accept import listen_socket
from adapter_fabric.node.data_server import DataServer
from adapter_fabric.node.peer_reads import FilePiece, Holds, Piece
from adapter_fabric.observability.metrics import DATA_CONNECTIONS
from adapter_fabric.rpc.limits import PeerStreamLimit
from adapter_fabric.transport import fetch_metadata
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.v1 import fabric_pb2

CHUNK = 4096
CHUNKS = 16


class FileReads:
    """Every chunk of ``path`` as a committed blob's piece, then what a node holding it all says (``PeerReads.pieces``'s shape)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def pieces(self, request: fabric_pb2.FetchRequest, holder: object) -> AsyncIterator[Piece]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for offset in range(0, size, CHUNK):
                yield FilePiece(offset, min(CHUNK, size - offset), f)
        yield Holds(complete=True)


class SendfileCountingLoop(asyncio.SelectorEventLoop):
    """The default event loop, counting its ``sendfile`` calls."""

    sendfiles = 0

    async def sendfile(self, *args, **kwargs):  # type: ignore[override]
        self.sendfiles += 1
        return await super().sendfile(*args, **kwargs)


class CountedLoop:
    """An event loop on its own thread that counts the tasks made on it (and its ``sendfile`` calls)."""

    def __init__(self) -> None:
        self.loop = SendfileCountingLoop()
        self.tasks = 0
        self.loop.set_task_factory(self._task)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def _task(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        self.tasks += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[CountedLoop, DataChannels, str, DataServer]]:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(CHUNK * CHUNKS))
    counted = CountedLoop()
    sock = listen_socket("127.0.0.1", 0)
    server = DataServer(FileReads(blob), PeerStreamLimit(4))  # type: ignore[arg-type] (FileReads: PeerReads.pieces's shape)
    counted.run(server.start(sock))
    channels, peer = DataChannels(), "127.0.0.1:1"
    channels.learn(peer, fetch_metadata.announce_data_port(sock.getsockname()[1]))
    try:
        yield counted, channels, peer, server
    finally:
        channels.close()
        counted.run(server.close(0.0))
        counted.stop()


def fetch(channels: DataChannels, peer: str) -> int:
    call = channels.open(peer, fabric_pb2.FetchRequest(digest="ab" * 32), None, CHUNK)
    assert call is not None
    chunks = sum(1 for _ in call)
    assert call.trailing_metadata()[0] == fetch_metadata.complete()[0]  # it read END: the connection is kept
    return chunks


def test_requests_on_a_kept_connection_make_no_task_per_frame_or_per_request(served) -> None:
    counted, channels, peer, _ = served
    kept = DATA_CONNECTIONS.labels("kept")._value.get()
    assert fetch(channels, peer) == CHUNKS  # the connection's own tasks (accept, serve) are made here
    before = counted.tasks
    for _ in range(3):
        assert fetch(channels, peer) == CHUNKS
    assert DATA_CONNECTIONS.labels("kept")._value.get() == kept + 3  # one connection carried them all
    # Each deadline (the hello's, each chunk's sendfile, the wait for the next hello) is a timer on the connection's
    # task (asyncio.timeout); asyncio.wait_for made a task per wait: 3 x (16 chunks + 2) = 54 before.
    assert counted.tasks - before == 0


def test_chunks_the_sockets_buffer_takes_at_once_skip_the_loops_sendfile(served) -> None:
    """A chunk goes by ``os.sendfile`` straight into the socket while its buffer has room (here: a 64 KiB stream into
    a loopback socket's buffer); ``loop.sendfile`` (pause, futures, a writer per chunk) only takes what would block.
    A reader that takes nothing is still cut: tests/transport/test_data_channel.py::test_a_reader_that_stops_reading_is_cut_and_frees_its_stream."""
    counted, channels, peer, _ = served
    for _ in range(3):
        assert fetch(channels, peer) == CHUNKS
    assert counted.loop.sendfiles == 0  # before: one per chunk, 48


def test_every_connection_the_node_accepts_has_nagle_off(served) -> None:
    """The socket option, not its timing (a timed check would race the 40 ms timer on a loaded box). asyncio turns Nagle
    off only for sockets made with proto IPPROTO_TCP, and accept()'s have 0. With it on, a chunk shorter than a segment
    waited for the ACK of the frame header sent before it, which the reader's kernel held for its 40 ms delayed-ACK
    timer: every request for a 15 KB adapter on a kept connection took 44 ms, against 0.55 ms without (issue 34)."""
    _, channels, peer, server = served
    assert fetch(channels, peer) == CHUNKS
    kept = list(server.listener._connections)  # the node's end of the connection the reader kept for its next request
    assert len(kept) == 1
    assert kept[0].sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
