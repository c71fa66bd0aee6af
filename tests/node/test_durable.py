"""Issue 19: durable nodes (--when-full refuse), the cluster's copies of last resort.

Real node processes: a seeder S holds a, b and c; a cache node C whose store
holds two adapters stages "solo", which no peer holds. A durable node D never
evicts and says so; C hands its last copy of solo to D before evicting it, and
keeps it when no durable node answers.

Durable peers are the mesh's tier of last resort: the cache nodes here run
``--homes 0`` (an operator's choice). With placement (the default) a Stage is
pushed to the id's homes, and a last copy goes to a home, not to any durable
peer (tests/node/test_homes.py, tests/transport/test_lookup.py).
"""

from __future__ import annotations

import pytest

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.transport import peer_calls
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.v1 import fabric_pb2
from tests.node.test_eviction import MESH, SMALL_CHUNK, cache_node, cli, seeder, staged  # noqa: F401 (seeder: a module fixture)
from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def durable_node(tmp_path, *extra: str) -> LocalNode:
    return LocalNode(tmp_path / "D", model="none", extra_args=[*SMALL_CHUNK, "--when-full", "refuse", *extra]).start()


def test_a_durable_node_never_evicts_refuses_by_name_and_says_what_it_is(tmp_path, seeder) -> None:
    peer = seeder["node"].address
    node = durable_node(tmp_path, "--max-store-bytes", str(seeder["size"] * 5 // 2))
    try:
        with node.client() as d:
            d.pull("a", peer=peer)
            d.pull("b", peer=peer)
            with pytest.raises(QuotaExceeded, match=r"this node is durable \(--when-full refuse\): it never evicts"):
                d.pull("c", peer=peer)
            assert staged(d) == ["a", "b"]
            assert d.store_status().evictions == 0 and not d.store_status().evicts
        channels = PeerChannels()
        try:
            assert peer_calls.is_durable(channels, node.address)  # what peers are told
            assert not peer_calls.is_durable(channels, peer)
        finally:
            channels.close()
        text = cli("store-status", node.address)
        assert text.returncode == 0 and "refuses commits (a durable node: never evicts)" in text.stdout, text.stdout + text.stderr
    finally:
        node.stop()


def test_a_last_copy_is_handed_to_a_durable_node_off_the_writers_path_and_then_evicted(tmp_path, seeder) -> None:
    peer = seeder["node"].address
    durable = durable_node(tmp_path)
    try:
        node = cache_node(tmp_path, seeder, "--metrics-listen", "127.0.0.1:0", *MESH, peers=[peer, durable.address])
        try:
            with node.client() as c, durable.client() as d:
                c.stage(seeder["dirs"]["solo"], "solo")  # no peer holds it, and it is the least recently used
                digest = c.manifest("solo").digest
                c.pull("b", peer=peer)
                # The pull of c needs room: solo, a last copy, is handed to the durable node in the background while b,
                # which the seeder holds, goes at once: the pull never waits on a hand-off.
                c.pull("c", peer=peer)
                assert staged(c) == ["c", "solo"]
                wait_for(lambda: scrape(node).get(("fabric_store_handoffs_total", frozenset({("outcome", "ok")}))) == 1, "the hand-off of solo")
                assert staged(d) == ["solo"] and d.manifest("solo").digest == digest
                assert scrape(node)[("fabric_store_evictions_total", frozenset())] == 1
                # The durable node's read of solo stamped it used, and raced c's commit (under load it came after). A read of
                # c now stamps it later than both, so which one is the least recently used does not depend on that race.
                list(c.stub.Fetch(fabric_pb2.FetchRequest(adapter_id="c"), timeout=30))
                c.pull("b", peer=peer)  # room again: solo, a copy the durable node holds now, is the least recently used and goes
                assert staged(c) == ["b", "c"]
                c.pull("solo", peer=durable.address)  # and it comes back from there (c, the least recently used, goes)
                assert staged(c) == ["b", "solo"]
        finally:
            node.stop()
    finally:
        durable.stop()


def test_with_no_durable_node_reachable_the_last_copy_is_kept_and_the_refusal_names_it(tmp_path, seeder) -> None:
    peer = seeder["node"].address
    gone = durable_node(tmp_path)
    gone.stop()  # a durable peer that no longer answers
    node = cache_node(tmp_path, seeder, *MESH, peers=[peer, gone.address])
    try:
        with node.client() as c:
            c.stage(seeder["dirs"]["solo"], "solo")
            c.pull("b", peer=peer)
            c.keep("b")
            # the last copy is held either as one (the hand-off to the gone durable peer failed) or as one being handed off (that
            # hand-off still under way when the round chose, as under load): the refusal names it either way
            held = r"(?=.*1 adapter is kept by an operator)(?=.*1 adapter is (the last complete copy among the known peers|a last copy being handed))"
            with pytest.raises(QuotaExceeded, match=held):
                c.pull("c", peer=peer)
            assert staged(c) == ["b", "solo"]
            assert c.store_status().evictions == 0
    finally:
        node.stop()
