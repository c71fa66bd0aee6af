"""Issue 29, items 1-4 and 10 (redirects): engines that drip, nest, list too much or redirect, and an SGLang that loads slowly.

Real node processes: a seed holds three adapters of one size; a sidecar node whose store holds two of them
(--max-store-bytes 2.5 sizes) watches a fake engine (--engine-url) or drives a fake SGLang (--sglang-url), both
``tests/support/fake_engines.py``, so its third pull evicts. Every engine read is bounded as a whole (5 s:
``node.engines.READ_TIMEOUT_S``); the bound each pull below is held to is its client deadline, never a timed assertion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.integrations.engine_models import MAX_CARDS
from adapter_fabric.store.export import export_name
from tests.integrations.test_engine_view import IDS, seed  # noqa: F401 (seed: a fixture, a seed node holding IDS, and their size)
from tests.node.test_hostile_weak_spots import log_lines
from tests.support.waiting import wait_for
from tests.support.fake_engines import NESTED, FakeEngine, FakeSGLang, models_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: a pull that evicts answers within this (the writer's wait for room, the engine read's 5 s whole-reply bound, and the pull
#: itself), or fails the test
PULL_BOUND_S = 30.0


def sidecar(tmp_path: Path, seed, *engine_args: str) -> LocalNode:
    seed_node, size = seed
    return LocalNode(
        tmp_path / "sidecar", model="none", port=free_port(), peers=[seed_node.address],
        extra_args=["--export-dir", str(tmp_path / "export"), "--max-store-bytes", str(int(size * 2.5)), *engine_args],
    ).start()  # fmt: skip


def pull(node: LocalNode, seed, adapter_id: str) -> None:
    """Pull ``adapter_id``; a writer that waited its ``ROOM_WAIT_S`` while the eviction read a slow engine asks again."""
    with node.client() as client:
        for _ in range(3):  # the eviction is bounded (5 s an engine read): the second ask finds its room made, or its refusal
            try:
                client.pull(adapter_id, peer=seed[0].address, timeout=PULL_BOUND_S)
                return
            except QuotaExceeded as exc:
                if "the node is making room" not in str(exc):
                    raise
        raise AssertionError(f"no room made for {adapter_id!r} in three asks")


def staged(node: LocalNode) -> list[str]:
    with node.client() as client:
        return sorted(a.adapter_id for a in client.list().staged)


def registered(node: LocalNode, adapters: int) -> int:
    return len(log_lines(node, "engine registrations", f"adapters={adapters}"))


def holding_the_first(tmp_path: Path, seed, engine: FakeEngine) -> LocalNode:
    """A sidecar watching ``engine``, which registers IDS[0]; IDS[0] and IDS[1] pulled (its store is full) and the engine read."""
    engine.registers((IDS[0], str(tmp_path / "export" / export_name(IDS[0]))))
    node = sidecar(tmp_path, seed, "--engine-url", engine.url)
    try:
        pull(node, seed, IDS[0])
        pull(node, seed, IDS[1])
        wait_for(lambda: registered(node, 1), "the watcher's first read")
    except BaseException:
        node.stop()
        raise
    return node


@pytest.fixture
def engine():
    fake = FakeEngine()
    yield fake
    fake.close()


@pytest.fixture
def sglang():
    fake = FakeSGLang()
    yield fake
    fake.close()


def test_an_engine_that_drips_its_list_delays_an_eviction_by_the_read_bound_only(seed, tmp_path, engine) -> None:
    node = holding_the_first(tmp_path, seed, engine)
    try:
        engine.mode = "drip"  # one byte every 2 s, for ever: each socket read gets one well inside any per-read timeout
        pull(node, seed, IDS[2])  # its eviction reads the engine: cut after 5 s, the registrations as last read hold IDS[0]
        assert staged(node) == sorted([IDS[0], IDS[2]])
        assert log_lines(node, "engine not answering", "within 5s (a bound on the whole reply)")
    finally:
        node.stop()


def test_nested_json_is_refused_by_name_and_the_watcher_keeps_polling(seed, tmp_path, engine) -> None:
    node = holding_the_first(tmp_path, seed, engine)
    try:
        engine.mode, engine.body = "body", NESTED
        pull(node, seed, IDS[2])  # was UNKNOWN: RecursionError out of the eviction's read
        assert staged(node) == sorted([IDS[0], IDS[2]])
        reads = engine.reads
        wait_for(lambda: engine.reads >= reads + 2, "two more polls of the nested reply")
        assert len(log_lines(node, "engine not answering", "RecursionError")) == 1  # once per state, not per poll
        engine.registers((IDS[0], "/elsewhere/one"), (IDS[2], "/elsewhere/three"))
        wait_for(lambda: registered(node, 2), "a poll after the nested replies (the watcher still runs)")
        assert "Traceback" not in node.log_path.read_text()
    finally:
        node.stop()


def test_an_adapter_past_a_hundred_thousand_cards_is_read_and_held(seed, tmp_path, engine) -> None:
    export = tmp_path / "export"
    engine.mode = "body"
    bases = [{"id": f"base-{i}", "root": f"base-{i}", "parent": None} for i in range(150_000)]
    engine.body = models_reply([*bases, {"id": "support", "root": str(export / export_name(IDS[0])), "parent": "base-0"}])
    node = sidecar(tmp_path, seed, "--engine-url", engine.url)
    try:
        pull(node, seed, IDS[0])
        pull(node, seed, IDS[1])
        pull(node, seed, IDS[2])  # IDS[0] is the least recently used, but card 150,001 names it (was: dropped, and evicted)
        assert staged(node) == sorted([IDS[0], IDS[2]])
    finally:
        node.stop()


def test_a_list_of_more_adapters_than_the_node_reads_holds_every_exported_one_and_says_so(seed, tmp_path, engine) -> None:
    engine.mode = "body"
    engine.body = models_reply([{"id": f"other-{i}", "root": f"/opt/loras/{i}", "parent": "tiny"} for i in range(MAX_CARDS + 1)])
    node = sidecar(tmp_path, seed, "--engine-url", engine.url)
    try:
        pull(node, seed, IDS[0])
        pull(node, seed, IDS[1])
        with pytest.raises(QuotaExceeded, match=f"engine {engine.label}'s GET /v1/models list is cut \\(it lists more than {MAX_CARDS} adapters"):
            pull(node, seed, IDS[2])  # was: the first 100,000 taken, none of them ours, and IDS[0] evicted
        assert staged(node) == sorted(IDS[:2])
        assert len(log_lines(node, "engine's model list cut", "every exported adapter is held")) == 1
    finally:
        node.stop()


def test_a_redirect_to_another_server_is_not_taken_for_the_engines_list(seed, tmp_path, engine) -> None:
    other = FakeEngine()
    other.registers((IDS[0], str(tmp_path / "export" / export_name(IDS[0]))))
    engine.mode, engine.redirect_to = "redirect", other.url
    node = sidecar(tmp_path, seed, "--engine-url", engine.url)
    try:
        pull(node, seed, IDS[0])
        pull(node, seed, IDS[1])
        with pytest.raises(QuotaExceeded, match=f"exported while engine {engine.label} has not answered GET /v1/models"):
            pull(node, seed, IDS[2])  # was: the other server's list taken as the engine's, IDS[1] evicted
        assert other.reads == 0
        assert log_lines(node, "engine not answering", "a redirect to", "no redirect is followed")
    finally:
        node.stop()
        other.close()


# ---------------------------------------------------------------- the driven SGLang


def test_an_eviction_does_not_wait_behind_a_slow_load(seed, tmp_path, sglang) -> None:
    sglang.hold_loads.add(export_name(IDS[1]))  # its load is answered only once the test opens the gate
    node = sidecar(tmp_path, seed, "--sglang-url", sglang.url, "--sglang-sync-interval", "1s")
    try:
        pull(node, seed, IDS[0])
        wait_for(lambda: export_name(IDS[0]) in sglang.loaded, "IDS[0] loaded")
        pull(node, seed, IDS[1])
        wait_for(sglang.load_started.is_set, "the load of IDS[1] under way")
        pull(node, seed, IDS[2])  # was: waited behind the load (up to its 30 s bound) holding the drive's lock: past the deadline
        assert staged(node) == sorted([IDS[1], IDS[2]])
        assert export_name(IDS[0]) not in sglang.loaded  # unloaded before its directory went
        sglang.gate.set()
        wait_for(lambda: {export_name(IDS[1]), export_name(IDS[2])} <= set(sglang.loaded), "the held load answered, the next loaded")
    finally:
        node.stop()


def test_an_sglang_that_drips_its_list_holds_its_adapters_within_the_bound(seed, tmp_path, sglang) -> None:
    node = sidecar(tmp_path, seed, "--sglang-url", sglang.url, "--sglang-sync-interval", "1s")
    try:
        pull(node, seed, IDS[0])
        pull(node, seed, IDS[1])
        wait_for(lambda: len(sglang.loaded) == 2, "both loaded")
        sglang.models_mode = "drip"
        with node.client() as client, pytest.raises(QuotaExceeded) as refused:
            client.pull(IDS[2], peer=seed[0].address, timeout=PULL_BOUND_S)  # was: no answer (a round held the drive's lock reading the drip)
        # within the writer's wait the round is still reading (5 s at most), or has refused naming the engine
        assert "the node is making room" in str(refused.value) or f"exported while engine {sglang.label} has not answered" in str(refused.value)
        wait_for(lambda: log_lines(node, "SGLang not answering", "within 5s (a bound on the whole reply)"), "the read cut at its bound")
        assert staged(node) == sorted(IDS[:2])
    finally:
        node.stop()


def test_nested_json_from_sglang_is_logged_once_and_the_drive_goes_on(seed, tmp_path, sglang) -> None:
    sglang.models_mode, sglang.models_body = "body", NESTED
    node = sidecar(tmp_path, seed, "--sglang-url", sglang.url, "--sglang-sync-interval", "1s")
    try:
        pull(node, seed, IDS[0])
        wait_for(lambda: len(log_lines(node, "SGLang not answering")) >= 1, "the nested reply logged")
        sglang.models_mode = "list"
        wait_for(lambda: export_name(IDS[0]) in sglang.loaded, "a load once SGLang lists again (was: the drive's task had died)")
        assert len(log_lines(node, "SGLang not answering", "RecursionError")) == 1
        assert "Traceback" not in node.log_path.read_text()
    finally:
        node.stop()
