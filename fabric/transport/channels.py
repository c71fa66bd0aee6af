"""One long-lived gRPC channel per peer address, with this node's credentials and token."""

from __future__ import annotations

import threading
from typing import Sequence

import grpc

from fabric.rpc import security
from fabric.transport import wire


class PeerChannels:
    """One long-lived channel per peer address (channels are expensive; connections are reused)."""

    def __init__(
        self, options: Sequence[tuple[str, object]] = wire.CHANNEL_OPTIONS, credentials: grpc.ChannelCredentials | None = None, token: str | None = None
    ) -> None:
        self._options = list(options)
        self._credentials = credentials
        self._token = token  # sent on every call when peers require it (--auth-token-file)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = security.channel(address, credentials=self._credentials, token=self._token, options=self._options)
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
