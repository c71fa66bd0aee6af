"""Issue 29, items 9 and 11: eviction's recency when the clock is stepped back, and what Stages refused on a full disk leave.

Real node processes. A cache node holding two of a seeder's three adapters (``tests/node/test_eviction.py``) is
restarted after one ref's stamp was put an hour ahead of the clock (what a clock stepped back an hour leaves
behind); a node whose store is on a 1 MiB tmpfs is filled up and sent Stages.
"""

from __future__ import annotations

import os
import time

import pytest

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode, free_port
from tests.node.test_eviction import cache_node, seeder, staged  # noqa: F401 (seeder: a module fixture)
from tests.node.test_hostile_weak_spots import log_lines
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_an_id_stamped_ahead_of_the_clock_is_still_the_least_recently_used(tmp_path, seeder) -> None:  # noqa: F811
    peer = seeder["node"].address
    node = cache_node(tmp_path, seeder)
    try:
        with node.client() as c:
            c.pull("a", peer=peer)
            c.pull("b", peer=peer)
        node.stop()
        ahead = time.time_ns() + 3600 * 10**9
        os.utime(node.store / "refs" / "a", ns=(ahead, ahead))  # a was used before the clock was stepped back an hour
        node.start()
        wait_for(lambda: log_lines(node, "collected what no ref reaches after the restart"), "the start-up scan of the refs")
        with node.client() as c:
            c.pull("b", peer=peer)  # b is used after the step: more recent than a, whatever the stamps' values
            c.pull("c", peer=peer)  # needs room: a is the least recently used (was: b went, a's stamp being ahead of the clock)
            assert staged(c) == ["b", "c"]
    finally:
        node.stop()




def test_stages_refused_on_a_full_disk_leave_no_upload_listed(tmp_path, small_disk, seeder) -> None:  # noqa: F811
    node = LocalNode(small_disk / "store", model="none", port=free_port(), log_path=tmp_path / "node.log").start()
    try:
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        (small_disk / "filler").write_bytes(b"\0" * free)  # not a block left
        with node.client() as c:
            for number, name in enumerate(("a", "b", "c")):
                with pytest.raises(QuotaExceeded, match="disk holding the adapter store is full"):
                    c.stage(seeder["dirs"][name], f"team/{name}-{number}")
            status = c.store_status()
        assert status.uploads == [] and status.uploads_total == 0, status.uploads  # was: one upload per Stage, no id, 0 B
        assert list((small_disk / "store" / "uploads").iterdir()) == []
    finally:
        node.stop()
