"""A data channel reader wakes once per chunk's worth of bytes, not per segment (``DataCall``, SO_RCVLOWAT), and
acknowledges a chunk as soon as it has read it (TCP_QUICKACK).

Before, each chunk took a ``recv`` per few segments (~34 per 1 MiB at 200 Mbit/s in a swarm, each a GIL hand-off), and
the node's END frame waited for the reader's delayed ACK (40 ms) on every other request of a kept connection. A raw
socket pair stands in for the node's side, so the bytes' arrival is ordered explicitly: part of a chunk, then the
reader seen waiting for the rest, then the rest.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from adapter_fabric.transport import data_frames
from adapter_fabric.transport.data_channel import QUICKACK, WAKE_BYTES, DataCall
from tests.support.waiting import wait_for

CHUNK = 64 << 10


class CountingSocket(socket.socket):
    """A socket that counts its ``recv_into`` calls."""

    recvs = 0

    def recv_into(self, *args, **kwargs) -> int:  # type: ignore[override]
        self.recvs += 1
        return super().recv_into(*args, **kwargs)


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def queued(sock: socket.socket) -> int:
    """Bytes in ``sock``'s receive queue, not read yet (SIOCINQ)."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_chunk_is_read_in_one_wake_and_the_next_frame_header_at_once() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    reader = CountingSocket(socket.AF_INET, socket.SOCK_STREAM)
    reader.connect(server.getsockname())
    reader.settimeout(60)  # a reader left waiting for bytes that never come fails the test, it does not hang it
    node, _ = server.accept()
    payload = bytes(range(256)) * (CHUNK // 256)
    kept: list[socket.socket] = []
    call = DataCall(reader, "127.0.0.1:1", 1, CHUNK, keep=kept.append)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.extend(bytes(data) for _, data in call))
    with node, server:
        node.sendall(data_frames.frame_header(data_frames.CHUNK, 0, CHUNK) + payload[:1024])
        thread.start()
        # The reader waits for the whole chunk (it is under WAKE_BYTES): the first KiB stays queued, unread.
        wait_for(lambda: lowat(reader) == CHUNK, "the reader to wait for the chunk's bytes", timeout=30)
        assert CHUNK <= WAKE_BYTES and queued(reader) == 1024
        before = reader.recvs
        node.sendall(payload[1024:])
        end = data_frames.encode_end(True, None)
        node.sendall(data_frames.frame_header(data_frames.END, 0, len(end)) + end)  # read with the low mark back at 1
        thread.join(30)
    assert not thread.is_alive() and got == [payload]
    assert reader.recvs - before <= 4  # the chunk's bytes (one wake, or two), then END's header and payload
    assert kept == [reader] and lowat(reader) == 1  # kept for the next request, with the low mark back at 1
    reader.close()


def test_a_reader_waiting_for_a_chunks_bytes_is_woken_by_a_cancel_or_the_peer_closing() -> None:
    """The swarm's stall watchdog cuts a stream by ``cancel`` (a shutdown from another thread); a peer that dies closes
    it: either wakes a reader that waits, under its low mark, for the rest of a chunk."""
    from adapter_fabric.transport.data_channel import DataChannelFailed

    server = socket.create_server(("127.0.0.1", 0))
    for ending in ("cancel", "peer closes"):
        reader = socket.create_connection(server.getsockname())
        reader.settimeout(60)
        node, _ = server.accept()
        call = DataCall(reader, "127.0.0.1:1", 1, CHUNK)
        failures: list[BaseException] = []

        def read() -> None:
            try:
                list(call)
            except DataChannelFailed as exc:
                failures.append(exc)

        thread = threading.Thread(target=read)
        with node:
            node.sendall(data_frames.frame_header(data_frames.CHUNK, 0, CHUNK) + b"\0" * 1024)
            thread.start()
            wait_for(lambda: lowat(reader) == CHUNK, "the reader to wait for the chunk's bytes", timeout=30)
            if ending == "cancel":
                call.cancel()
        thread.join(30)  # "peer closes": the node's end closed as the with block ended
        assert not thread.is_alive() and len(failures) == 1, ending
        assert ("was cancelled" if ending == "cancel" else "closed the data channel mid-stream") in str(failures[0].error)
    server.close()


def unacked(sock: socket.socket) -> int:
    """Segments ``sock`` sent that its peer has not acknowledged yet (``tcpi_unacked`` of Linux's struct tcp_info)."""
    return struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 24)[0]


@pytest.mark.skipif(QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_a_chunk_is_acknowledged_as_soon_as_it_is_read() -> None:
    """Requests on a kept connection look interactive to the kernel, so it holds the reader's ACKs back (up to its 40 ms
    delayed-ACK timer) to ride on the next request, which waits for END, which a node sending with Nagle on (as every
    node did before issue 34's ninth step, and as this test's node end does) held until that ACK. The node's side must
    see every chunk acknowledged once the reader has it: checked at once (a short grace, far under the timer's 40 ms,
    for a loaded box's softirq), on five requests in turn (without TCP_QUICKACK, the second one here always waited)."""
    chunk = 1 << 20
    server = socket.create_server(("127.0.0.1", 0))
    reader = socket.create_connection(server.getsockname())
    reader.settimeout(60)
    reader.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as DataChannels connects
    node, _ = server.accept()
    payload = bytes(range(256)) * (chunk // 256)
    end = data_frames.encode_end(True, None)
    left_unacked = []
    with node, server, reader:
        for _ in range(5):
            reader.sendall(b"hello")  # the request (its bytes do not matter to the reader)
            assert node.recv(5) == b"hello"
            call = iter(DataCall(reader, "127.0.0.1:1", 1, chunk, keep=lambda _: None))
            node.sendall(data_frames.frame_header(data_frames.CHUNK, 0, chunk) + payload)
            _, data = next(call)
            assert bytes(data) == payload
            grace = time.monotonic() + 0.01
            while unacked(node) and time.monotonic() < grace:
                time.sleep(0.001)
            left_unacked.append(unacked(node))
            node.sendall(data_frames.frame_header(data_frames.END, 0, len(end)) + end)
            assert list(call) == []
    assert left_unacked == [0] * 5
