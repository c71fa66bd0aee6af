"""A data channel stream refused by the channel's own bound, or broken before its first frame, becomes the gRPC Fetch of the
same request at once (``DataCall``'s fallback); a refusal by a bound gRPC is under too does not. A raw socket server
answering as a node at its bounds does, no node process."""

from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest

from adapter_fabric.errors import DATA_CONNECTIONS_BOUND, FIRST_COPIES_BOUND, PEER_STREAMS_BOUND, AdapterNotFound, QuotaExceeded
from adapter_fabric.observability.metrics import DATA_FALLBACKS
from adapter_fabric.rpc.status import error_detail, public_message
from adapter_fabric.transport import data_frames, fetch_metadata
from adapter_fabric.transport.data_channel import DataChannelFailed, DataChannels
from adapter_fabric.v1 import fabric_pb2


class OneAnswer:
    """A TCP server that answers each connection with ``reply`` (bytes; b"" closes at once) and closes it."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)  # the hello
                conn.sendall(self.reply)


class GrpcStandIn:
    """What ``peer_calls.fetch`` hands as the fallback: an iterator of (offset, data) with FetchCall's methods."""

    def __init__(self) -> None:
        self.made = 0
        self.cancelled = False

    def __call__(self) -> "GrpcStandIn":
        self.made += 1
        self._items: Iterator[tuple[int, bytes]] = iter([(0, b"chunk")])
        return self

    def __iter__(self) -> "GrpcStandIn":
        return self

    def __next__(self) -> tuple[int, bytes]:
        return next(self._items)

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return fetch_metadata.complete()

    def cancel(self) -> None:
        self.cancelled = True


def refusal_frame(error) -> bytes:
    payload = error_detail(error, public_message(error))
    return data_frames.frame_header(data_frames.ERROR, 0, len(payload)) + payload


@pytest.fixture
def request_pb() -> fabric_pb2.FetchRequest:
    return fabric_pb2.FetchRequest(digest="ab" * 32, file="adapter_model.safetensors")


def channel_to(port: int) -> tuple[DataChannels, str]:
    channels = DataChannels()
    peer = "127.0.0.1:1"
    channels.learn(peer, fetch_metadata.announce_data_port(port))
    return channels, peer


@pytest.mark.parametrize(("reply", "reason"), [(refusal_frame(QuotaExceeded("holds 256 connections already")), "busy"), (b"", "broken")])
def test_a_stream_refused_as_busy_or_cut_before_its_first_frame_goes_over_grpc_at_once(request_pb, reply, reason) -> None:
    server = OneAnswer(reply)
    channels, peer = channel_to(server.port)
    grpc_call = GrpcStandIn()
    before = DATA_FALLBACKS.labels(reason)._value.get()
    call = channels.open(peer, request_pb, None, 4096, fallback=grpc_call)
    assert call is not None
    assert list(call) == [(0, b"chunk")] and grpc_call.made == 1  # the same request, over gRPC, at once
    assert call.trailing_metadata() == fetch_metadata.complete()
    assert DATA_FALLBACKS.labels(reason)._value.get() == before + 1
    assert channels.port(peer) is None  # that peer is fetched from over gRPC for a while


@pytest.mark.parametrize(
    ("bound", "beside", "to_grpc"),
    [
        (DATA_CONNECTIONS_BOUND, True, True),  # the channel's own bound: gRPC is not under it, even beside other streams
        (DATA_CONNECTIONS_BOUND, False, True),
        (PEER_STREAMS_BOUND, False, False),  # a lone stream refused by streams per peer: gRPC counts against it too
        (FIRST_COPIES_BOUND, False, False),  # a seed sending the caller elsewhere: gRPC would hear the same
        ("", False, True),  # an older node names no bound: a lone stream is taken as refused by the connection bound
        ("", True, False),  # ... and one beside others as refused by streams per peer
    ],
)
def test_a_busy_refusal_goes_over_grpc_only_when_its_bound_is_the_channels_own(request_pb, bound, beside, to_grpc) -> None:
    server = OneAnswer(refusal_frame(QuotaExceeded("refused as busy", bound)))
    channels, peer = channel_to(server.port)
    grpc_call = GrpcStandIn()
    before = DATA_FALLBACKS.labels("busy")._value.get()
    call = channels.open(peer, request_pb, None, 4096, fallback=grpc_call)
    assert call is not None
    call.grpc_when_busy = not beside
    if to_grpc:
        assert list(call) == [(0, b"chunk")] and grpc_call.made == 1
        assert channels.port(peer) is None and DATA_FALLBACKS.labels("busy")._value.get() == before + 1
        return
    with pytest.raises(DataChannelFailed) as failed:
        list(call)
    assert isinstance(failed.value.error, QuotaExceeded) and failed.value.error.bound == bound and grpc_call.made == 0
    assert channels.port(peer) == server.port and DATA_FALLBACKS.labels("busy")._value.get() == before  # the channel stays in use


def test_a_refusal_of_another_kind_is_the_callers_to_hear(request_pb) -> None:
    server = OneAnswer(refusal_frame(AdapterNotFound("no adapter with that digest")))
    channels, peer = channel_to(server.port)
    grpc_call = GrpcStandIn()
    call = channels.open(peer, request_pb, None, 4096, fallback=grpc_call)
    with pytest.raises(DataChannelFailed) as failed:
        list(call)
    assert isinstance(failed.value.error, AdapterNotFound) and grpc_call.made == 0  # gRPC would say the same
