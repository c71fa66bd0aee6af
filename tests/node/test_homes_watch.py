"""The placement loop (``Homes.watch``) outlives a re-homing that fails: a store that cannot be read when the members
change is logged, and the next change is re-homed again (the loop also refreshes --peers-dns; had it ended, the node
would keep its members of that moment for good).

In-process: the node's ``Homes`` over a ``MemberView`` and a real store whose census raises, as a vanished store's does.
"""

from __future__ import annotations

import asyncio

from adapter_fabric.node import homes as homes_module
from adapter_fabric.node.homes import Homes
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.members import MemberView

ME = "10.0.0.1:50051"
OTHERS = [f"10.0.0.{i}:50051" for i in range(2, 5)]


async def test_a_re_homing_that_fails_leaves_the_members_watched(tmp_path, monkeypatch, caplog) -> None:
    store = AdapterStore(tmp_path / "store")
    view = MemberView(ME, OTHERS, is_self=lambda address, listen: address == listen)
    homes = Homes(view, 3, PeerChannels(), store, lambda: 0)
    reads: list[int] = []

    def census():
        reads.append(len(view.fleet()))
        raise OSError("the store's refs/ went away")

    async def io(call, *args):
        return call(*args)

    monkeypatch.setattr(store, "census", census)
    monkeypatch.setattr(homes_module, "DNS_REFRESH_S", 0.01)
    watch = asyncio.create_task(homes.watch(io))
    try:
        await asyncio.sleep(0.05)  # its first pass takes the members as they are: no re-homing, no read
        assert reads == []
        for joined, members in ((["10.0.9.1:50051"], 5), (["10.0.9.1:50051", "10.0.9.2:50051"], 6)):
            view.update("dns", joined)
            for _ in range(200):
                if len(reads) and reads[-1] == members:
                    break
                await asyncio.sleep(0.01)
            assert reads[-1] == members and not watch.done()
        assert "re-homing after the members changed failed: the store's refs/ went away" in caplog.text
    finally:
        watch.cancel()
        homes.close()
