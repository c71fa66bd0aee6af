"""One long-lived gRPC channel per peer address, with this node's credentials and token; and the peers' data channels."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import grpc

from adapter_fabric.rpc import security
from adapter_fabric.rpc.status import ERROR_DETAIL_KEY
from adapter_fabric.transport import wire
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.store.lock_watch import check_no_store_lock


class PeerChannels:
    """One long-lived channel per peer address (channels are expensive; connections are reused).

    ``data``: the peers' data channels (``adapter_fabric.transport.data_channel``), or None to fetch over gRPC only.
    """

    def __init__(
        self,
        options: Sequence[tuple[str, object]] = wire.CHANNEL_OPTIONS,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        data: DataChannels | None = None,
    ) -> None:
        self.data = data
        self._options = list(options)
        self._credentials = credentials
        self._token = token  # sent on every call when peers require it (--auth-token-file)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (made once): every peer call takes it here, so here it is checked that no store lock is held."""
        check_no_store_lock(f"a call to peer {address}")
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = security.channel(address, credentials=self._credentials, token=self._token, options=self._options)
                self._channels[address] = channel
            return channel

    def failed(self, address: str, exc: grpc.RpcError) -> None:
        """Forget ``address``'s channel after a transport failure (UNAVAILABLE that no node said), so the next call dials
        afresh: a channel that met "connection refused" waits out its reconnect backoff (seconds, growing), and a peer
        that restarted meanwhile was answered "connection refused" until then, though it said SERVING."""
        said = any(key == ERROR_DETAIL_KEY for key, _ in (exc.trailing_metadata() or ())) if hasattr(exc, "trailing_metadata") else True
        if said or not hasattr(exc, "code") or exc.code() != grpc.StatusCode.UNAVAILABLE:
            return
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()  # a connection that failed carries no other call worth keeping

    def learn(self, peer: str, metadata: Any) -> None:
        """Note the data channel port ``peer`` announced (or not) in a reply's metadata."""
        if self.data is not None and metadata is not None:
            self.data.learn(peer, metadata)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
