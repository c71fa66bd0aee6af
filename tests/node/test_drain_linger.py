"""A draining node listens on until the receivers that were reading from it have heard why (bounded)."""

from __future__ import annotations

import asyncio

import pytest

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.node import background
from adapter_fabric.rpc.limits import PeerStreamLimit


def test_a_receiver_reading_at_the_signal_is_waited_for_until_it_is_refused() -> None:
    async def scenario() -> None:
        streams = PeerStreamLimit(4)
        streams.enter("10.0.0.7")
        streams.close("this node is shutting down")
        ending = asyncio.create_task(background.streams_ended(streams, within=60.0))
        streams.leave("10.0.0.7")  # its stream ended well; its next request has not come yet
        await asyncio.sleep(background.DRAIN_LINGER_S * 2)
        assert not ending.done(), "stopped listening before the receiver that was reading heard why"
        with pytest.raises(PeerUnavailable, match="shutting down"):
            streams.enter("10.0.0.7")
        await asyncio.wait_for(ending, timeout=30)

    asyncio.run(scenario())


def test_a_node_nobody_was_reading_from_stops_at_once_and_the_wait_is_bounded() -> None:
    async def scenario() -> None:
        idle = PeerStreamLimit(4)
        idle.close("shutting down")
        await asyncio.wait_for(background.streams_ended(idle, within=60.0), timeout=30)
        gone = PeerStreamLimit(4)
        gone.enter("10.0.0.8")
        gone.close("shutting down")
        gone.leave("10.0.0.8")  # it never asks again: the longer linger still ends
        await asyncio.wait_for(background.streams_ended(gone, within=60.0), timeout=30)

    asyncio.run(scenario())
