"""Issue 32: after the members change, a copy its node is no home of any more is a surplus copy, and eviction drops it
before any home copy, however recently used. In-process: a real store, the node's ``Homes`` over a ``MemberView``, the
eviction's ``Candidates`` (``home_ids`` from the members now) and the pure choice (``store.eviction.choose_victims``)."""

from __future__ import annotations

from adapter_fabric.node.homes import Homes
from adapter_fabric.node.in_use import InUse
from adapter_fabric.node.victims import Candidates
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.eviction import choose_victims
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.members import MemberView
from adapter_fabric.transport.placement import Fleet

ME = "10.0.0.1:50051"
OTHERS = [f"10.0.0.{i}:50051" for i in range(2, 6)]
NEWCOMER = "10.0.9.9:50051"
K = 3


def test_a_former_homes_copy_goes_before_its_home_copies_once_the_members_change(tmp_path, store_adapters) -> None:
    before, after = Fleet.of([ME, *OTHERS]), Fleet.of([ME, *OTHERS, NEWCOMER])
    ids = [f"team/adapter-{i}" for i in range(1000)]
    displaced = next(i for i in ids if ME in before.homes(i, K) and ME not in after.homes(i, K))  # the newcomer takes its home
    kept = next(i for i in ids if ME in before.homes(i, K) and ME in after.homes(i, K))
    store = AdapterStore(tmp_path / "store", chunk_size=4096)
    store.stage(store_adapters["b"], kept)
    store.stage(store_adapters["c"], displaced)
    store.touch(displaced)  # the displaced id is the most recently used: only placement puts it first
    view = MemberView(ME, OTHERS, is_self=lambda address, listen: address == listen)
    homes = Homes(view, K, PeerChannels(), store, lambda: 0)
    try:
        candidates = Candidates(store, InUse(), set, home_ids=homes.home_ids)
        used = sum(c.size for c in candidates())

        def first_victim() -> str:
            victims = choose_victims(candidates(), needed=1, used=used, limit=used, low_water=1.0, what="a test")
            assert len(victims) == 1
            return victims[0].ids[0]

        assert all(c.home for c in candidates()) and first_victim() == kept  # both home copies: the least recently used goes
        view.update("dns", [NEWCOMER])  # a member joins (as --peers-dns would show it)
        assert {c.ids[0]: c.home for c in candidates()} == {kept: True, displaced: False}
        assert first_victim() == displaced  # the surplus copy goes first, though used last
    finally:
        homes.close()
