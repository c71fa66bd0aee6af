"""One long-lived gRPC channel per peer address, with this node's credentials for members only; and the peers' data channels.

A member of the cluster (``adapter_fabric.transport.membership``) gets the node's
peer token and client certificate; any other address gets a channel with
neither (TLS still verifies the server). A pull on a caller's behalf
(``for_caller``) adds the caller's identity to every call to a member
(``security.ON_BEHALF_OF_KEY``), so the holder admits only what both may do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from adapter_fabric.rpc import security
from adapter_fabric.rpc.status import ERROR_DETAIL_KEY
from adapter_fabric.store.lock_watch import check_no_store_lock
from adapter_fabric.transport import wire
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.membership import Membership


class _Pool:
    """The channels themselves, shared by a node's ``PeerChannels`` and every view of it made for a caller."""

    def __init__(self) -> None:
        self.channels: dict[tuple[str, bool], grpc.Channel] = {}  # (address, credentialed) -> channel
        self.lock = threading.Lock()
        self.one_stream: dict[str, float] = {}  # address -> until when it is asked one stream at a time (``refused_beside``)


#: seconds a peer that refused a stream beside another of ours is asked one at a time (then two are tried again)
ONE_STREAM_S = 60.0
#: peers remembered so (the oldest forgotten first): a node pulls from its members
MAX_ONE_STREAM_PEERS = 1024


class PeerChannels:
    """One long-lived channel per peer address (channels are expensive; connections are reused).

    ``data``: the peers' data channels (``adapter_fabric.transport.data_channel``), or None to fetch over gRPC only.
    ``members``: who gets ``credentials``' client certificate and ``token`` (None: every address, as a client library
    dialling its own peers does); others get ``anonymous_credentials`` (TLS without a client certificate) and no token.
    """

    def __init__(
        self,
        options: Sequence[tuple[str, object]] = wire.CHANNEL_OPTIONS,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        data: DataChannels | None = None,
        *,
        members: Membership | None = None,
        anonymous_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.data = data
        self.members = members
        #: the identity of the caller this view pulls for ("" = the node itself)
        self.behalf = ""
        self._options = list(options)
        self._credentials = credentials
        self._anonymous_credentials = anonymous_credentials if anonymous_credentials is not None else credentials
        self._token = token  # sent on every call to a member (--peer-token-file)
        self._pool = _Pool()
        self._owner = True

    def admits(self, address: str) -> bool:
        """Whether this node's credentials go to ``address`` (a member, or every address when no membership is set)."""
        return self.members is None or self.members.admits(address)

    def get(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (made once; with credentials for a member only): every peer call takes it here, so here
        it is checked that no store lock is held."""
        check_no_store_lock(f"a call to peer {address}")
        member = self.admits(address)
        with self._pool.lock:
            channel = self._pool.channels.get((address, member))
            if channel is None:
                if member:
                    channel = security.channel(address, credentials=self._credentials, token=self._token, options=self._options)
                else:
                    channel = security.channel(address, credentials=self._anonymous_credentials, options=self._options)
                self._pool.channels[(address, member)] = channel
        if member and self.behalf:
            return grpc.intercept_channel(channel, security.metadata_interceptor(((security.ON_BEHALF_OF_KEY, self.behalf),)))
        return channel

    def for_caller(self, identity: str) -> PeerChannels:
        """A view whose calls (and data channel hellos) to members name ``identity`` as the caller they are made for; the same
        channels underneath. ``identity`` "" is this object itself (the node pulls as itself)."""
        if not identity:
            return self
        view = PeerChannels.__new__(PeerChannels)
        view.__dict__.update(self.__dict__)
        view.behalf = identity
        view._owner = False
        return view

    def failed(self, address: str, exc: grpc.RpcError) -> None:
        """Forget ``address``'s channel after a transport failure (UNAVAILABLE that no node said), so the next call dials
        afresh: a channel that met "connection refused" waits out its reconnect backoff (seconds, growing), and a peer
        that restarted meanwhile was answered "connection refused" until then, though it said SERVING."""
        said = any(key == ERROR_DETAIL_KEY for key, _ in (exc.trailing_metadata() or ())) if hasattr(exc, "trailing_metadata") else True
        if said or not hasattr(exc, "code") or exc.code() != grpc.StatusCode.UNAVAILABLE:
            return
        with self._pool.lock:
            gone = [self._pool.channels.pop((address, member), None) for member in (True, False)]
        for channel in gone:
            if channel is not None:
                channel.close()  # a connection that failed carries no other call worth keeping

    def refused_beside(self, address: str) -> None:
        """``address`` refused a stream beside another of ours (its ``--max-streams-per-peer``): pulls from it alone ask one
        stream at a time for ``ONE_STREAM_S``, so each does not meet the refusal again."""
        with self._pool.lock:
            marks = self._pool.one_stream
            marks.pop(address, None)
            marks[address] = time.monotonic() + ONE_STREAM_S
            while len(marks) > MAX_ONE_STREAM_PEERS:
                del marks[next(iter(marks))]

    def takes_streams_beside(self, address: str) -> bool:
        """Whether a pull from ``address`` alone may open more than one stream to it (it refused none lately)."""
        with self._pool.lock:
            return self._pool.one_stream.get(address, 0.0) <= time.monotonic()

    def learn(self, peer: str, metadata: Any) -> None:
        """Note the data channel port ``peer`` announced (or not) in a reply's metadata."""
        if self.data is not None and metadata is not None:
            self.data.learn(peer, metadata)

    def close(self) -> None:
        if not self._owner:
            return
        if self.data is not None:
            self.data.close()
        with self._pool.lock:
            for channel in self._pool.channels.values():
                channel.close()
            self._pool.channels.clear()
