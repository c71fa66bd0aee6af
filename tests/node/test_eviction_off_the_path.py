"""Issue 30: eviction runs as a node service outside every store lock, so nothing slow it waits on holds up other calls.

Real node processes. A cache node C (room for two adapters of the seeder's
three) is made to need an eviction while what the eviction waits on hangs:

- a durable peer that accepts the hand-off of a last copy and then holds it
  (``tests/support/peers/holding_peer.py`` in front of a real durable node);
- an engine (``--engine-url``) whose ``GET /v1/models`` sends a byte every 2 s;
- a driven SGLang (``--sglang-url``) that answers each load after 20 s.

Meanwhile C's reads answer at once, a Stage that needs no room is staged at
once, and the Stage that needs room answers within the writer's wait
(``ROOM_WAIT_S``), staged or refused by name. Without the change each of them
waited behind the eviction (a hand-off's 120 s bound). The bounds below are
bounds on hanging, tens of times what the calls take (milliseconds), not
speed assertions.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.node.eviction import ROOM_WAIT_S
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.fake_engines import FakeEngine, FakeSGLang
from tests.node.test_eviction import MESH, SMALL_CHUNK, cache_node, seeder, staged  # noqa: F401 (seeder: a module fixture)
from tests.support.relays import HoldingRelay
from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: a read of a node whose eviction waits on something slow: it answers in milliseconds (this bounds a hang, not a speed)
READ_BOUND_S = 2.0
#: a Stage answers within the writer's wait for room, plus the upload itself
STAGE_BOUND_S = ROOM_WAIT_S + 5.0


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory, seeder) -> dict:  # noqa: F811 (the fixture imported above)
    """An adapter of the seeder's shape that no node holds: staging it on a full cache node needs room."""
    directory = make_peft_adapter(
        tmp_path_factory.mktemp("newcomer") / "x", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=88
    )
    return {"dir": directory}


def timed(call: Callable[[], object]) -> tuple[object, float]:
    """``call()``'s result (or the fabric error it raised) and the seconds it took."""
    started = time.monotonic()
    try:
        result: object = call()
    except QuotaExceeded as exc:
        result = exc
    return result, time.monotonic() - started


def reads_answer_at_once(client, adapter_id: str) -> None:
    """ListAdapters, StoreStatus, GetManifest and Locate each answer within READ_BOUND_S."""
    for name, read in (
        ("ListAdapters", lambda: client.list(timeout=READ_BOUND_S)),
        ("StoreStatus", lambda: client.store_status(timeout=READ_BOUND_S)),
        ("GetManifest", lambda: client.manifest(adapter_id, timeout=READ_BOUND_S)),
        ("Locate", lambda: client.locate(adapter_id, timeout=READ_BOUND_S)),
    ):
        _, took = timed(read)
        assert took < READ_BOUND_S, f"{name} took {took:.1f}s while the eviction waited"


@contextmanager
def stage_in_background(client, directory, adapter_id: str) -> Iterator[dict]:
    """Stage in a thread; the dict gets ``result`` (the StageResult or the QuotaExceeded) and ``took`` when it ends."""
    outcome: dict = {}

    def run() -> None:
        outcome["result"], outcome["took"] = timed(lambda: client.stage(directory, adapter_id, timeout=60))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield outcome
    finally:
        thread.join(120)


def test_a_hand_off_that_hangs_holds_up_no_read_and_no_stage_and_loses_no_last_copy(tmp_path, seeder, newcomer) -> None:  # noqa: F811
    peer = seeder["node"].address
    durable = LocalNode(tmp_path / "D", model="none", extra_args=[*SMALL_CHUNK, "--when-full", "refuse"]).start()
    try:
        with HoldingRelay(durable.address) as relay:
            # the mesh (--homes 0): a last copy goes to a durable peer (with placement, to a home: the Stage pushes it there)
            node = cache_node(tmp_path, seeder, "--metrics-listen", "127.0.0.1:0", *MESH, peers=[peer, relay.address])
            try:
                with node.client() as c, durable.client() as d:
                    c.stage(seeder["dirs"]["solo"], "solo")  # no peer holds it: a last copy, and the least recently used
                    c.pull("b", peer=peer)
                    c.keep("b")  # solo is the only adapter that may go, and it may go only once a durable peer holds it
                    with stage_in_background(c, newcomer["dir"], "x") as needing_room:
                        assert relay.wait_holding() == "solo"  # the durable peer took the hand-off, and hangs
                        reads_answer_at_once(c, "b")
                        # Bytes C holds already (staged here, so at C's chunk size): one more id, no room needed.
                        alias, took = timed(lambda: c.stage(seeder["dirs"]["solo"], "solo-again", timeout=60))
                        assert took < STAGE_BOUND_S and not isinstance(alias, QuotaExceeded), alias
                    result, took = needing_room["result"], needing_room["took"]
                    assert took < STAGE_BOUND_S, f"the Stage that needed room answered after {took:.1f}s"
                    assert isinstance(result, QuotaExceeded), result  # nothing else may go: refused, naming what is under way
                    assert "handing 1 last copy to a durable peer first ('solo'" in str(result) and "retry" in str(result), result
                    assert "PeerUnavailable" not in str(result)  # no other call's peer error
                    assert staged(c) == ["b", "solo", "solo-again"]

                    relay.go()  # the durable peer pulls solo from C now
                    handed = ("fabric_store_handoffs_total", frozenset({("outcome", "ok")}))
                    wait_for(lambda: scrape(node).get(handed) == 1, "the hand-off to end")
                    assert staged(d) == ["solo"]  # the last copy is safe
                    c.stage(newcomer["dir"], "x", timeout=60)  # and now solo, held by the durable node, makes room
                    assert staged(c) == ["b", "x"] and staged(d) == ["solo"]
            finally:
                node.stop()
    finally:
        durable.stop()


def slow_engine_case(tmp_path, seeder, newcomer, *engine_flags: str) -> None:  # noqa: F811
    """C full of two adapters the seeder holds, ``a`` kept (so ``b`` goes), and an engine that keeps the eviction waiting:
    every other call answers at once, and the Stage that needs room answers within the writer's wait, staged or refused
    by name. ``a`` is kept so that ``a-again`` (its bytes under another id) needs no room: were ``a`` the victim, its
    bytes gone by then, ``a-again`` took the room made for ``x`` (it failed so once in a full suite)."""
    peer = seeder["node"].address
    node = cache_node(tmp_path, seeder, *engine_flags)
    try:
        with node.client() as c:
            c.stage(seeder["dirs"]["a"], "a")  # staged here (at C's chunk size), and the seeder holds it too: it may go
            c.pull("b", peer=peer)
            c.keep("a")
            with stage_in_background(c, newcomer["dir"], "x") as needing_room:
                reads_answer_at_once(c, "a")
                alias, took = timed(lambda: c.stage(seeder["dirs"]["a"], "a-again", timeout=60))  # bytes held here: no room needed
                assert took < STAGE_BOUND_S and not isinstance(alias, QuotaExceeded), alias
            result, took = needing_room["result"], needing_room["took"]
            assert took < STAGE_BOUND_S, f"the Stage that needed room answered after {took:.1f}s"
            if isinstance(result, QuotaExceeded):  # still making room, or (a driven SGLang's slow load not waited for) why none can be made
                assert ("the node is making room" in str(result) and "retry" in str(result)) or "nothing more can be evicted" in str(result), result
            reads_answer_at_once(c, "a")
    finally:
        node.stop()


def test_an_engine_that_drips_its_model_list_holds_up_no_other_call(tmp_path, seeder, newcomer) -> None:  # noqa: F811
    engine = FakeEngine()  # tests/support/fake_engines.py
    engine.mode = "drip"  # GET /v1/models answers 200, then one byte of its body every 2 s, for as long as it is read
    try:
        slow_engine_case(tmp_path, seeder, newcomer, "--engine-url", engine.url)
    finally:
        engine.close()


def test_a_driven_sglang_that_loads_slowly_holds_up_no_other_call(tmp_path, seeder, newcomer) -> None:  # noqa: F811
    sglang = FakeSGLang()
    sglang.load_delay = 20.0  # each load answers after 20 s: a reconcile round of two loads takes 40 s
    try:
        slow_engine_case(tmp_path, seeder, newcomer, "--export-dir", str(tmp_path / "export"), "--sglang-url", sglang.url)
    finally:
        sglang.close()
