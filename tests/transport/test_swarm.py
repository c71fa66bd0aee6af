"""Swarm distribution: the scheduling policy on plain data, peer discovery, and real nodes sharing chunks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from adapter_fabric.transport import swarm

from adapter_fabric.transport import fetch_metadata, wire
from adapter_fabric.transport.swarm_pull import TRACE_ENV
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.transport.discovery import PeerSource, resolve
from adapter_fabric.errors import FIRST_COPIES_BOUND, AdapterNotFound, InvalidArgument
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.digests import chunk_digest, hash_file
from adapter_fabric.v1 import fabric_pb2
from tests.support.relays import GatedRelay

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL_CHUNK = ["--chunk-size", "4096"]


# ------------------------------------------------------------ policy, no sockets


def plan_of(chunks: int, peers: dict[str, set[int] | None], seed: int = 7, verified=()) -> swarm.SwarmPlan:
    """``peers``: address -> chunks it holds (None = complete)."""
    plan = swarm.new_plan(chunks, verified, list(peers), seed=seed)
    for address, have in peers.items():
        swarm.set_holding(plan, address, have or (), complete=have is None)
    return plan


def test_windows_fill_every_peer_with_distinct_chunks() -> None:
    plan = plan_of(12, {"a": None, "b": None, "c": None})
    made = swarm.plan_requests(plan, now=0.0, window=2, max_run=1)
    assert sorted(len([r for r in made if r.peer == p]) for p in "abc") == [2, 2, 2]
    chunks = [c for r in made for c in r.chunks]
    assert len(chunks) == len(set(chunks)) == 6
    assert swarm.plan_requests(plan, now=0.0, window=2) == []  # windows full


def test_a_peer_is_asked_only_for_chunks_it_holds() -> None:
    plan = plan_of(8, {"seed": None, "half": {0, 1, 2}})
    made = swarm.plan_requests(plan, now=0.0, window=4, max_run=1)
    assert all(c in {0, 1, 2} for r in made if r.peer == "half" for c in r.chunks)
    assert len([r for r in made if r.peer == "half"]) == 3 - len([r for r in made if r.peer == "seed" and r.chunks[0] in {0, 1, 2}])


def test_rarest_chunk_first() -> None:
    # Chunk 5 is held by the seed alone; 0-4 also by two partial peers. The seed is asked for 5.
    plan = plan_of(6, {"seed": None, "p1": {0, 1, 2, 3, 4}, "p2": {0, 1, 2, 3, 4}})
    made = swarm.plan_requests(plan, now=0.0, window=1, max_run=1)
    assert [r.chunks for r in made if r.peer == "seed"] == [[5]]


def test_the_rarity_kept_as_holdings_change_equals_a_count_over_every_live_peer() -> None:
    """The plan keeps each chunk's live holders as announcements, losses and deaths arrive (``whole`` + ``partly``);
    after every change of a random sequence it must equal the count over every live peer, the way it used to be made."""
    rng = random.Random(34)
    chunks, addresses = 40, [f"p{i}" for i in range(12)]
    plan = swarm.new_plan(chunks, (), addresses, seed=1)
    for _ in range(600):
        address, kind = rng.choice(addresses), rng.random()
        if kind < 0.55:
            swarm.set_holding(plan, address, rng.sample(range(chunks + 3), rng.randint(0, 20)), complete=rng.random() < 0.2)
        elif kind < 0.9:
            swarm.forget_chunks(plan, address, rng.sample(range(chunks), rng.randint(0, 10)))
        elif not plan.peers[address].dead:
            swarm.mark_dead(plan, address)
        live = swarm.live_peers(plan)
        assert [plan.whole + plan.partly[c] for c in range(chunks)] == [sum(p.holds(c) for p in live) for c in range(chunks)]


def test_planning_a_pull_costs_about_the_same_whatever_the_number_of_peers_that_hold_nothing(monkeypatch) -> None:
    """A pull on a node that knows many members: they hold nothing of it, so planning each request must not walk them
    for every chunk (a node knowing 1,000 members planned its 84 requests in ~380 ms). Counted in ``holds`` calls, not
    timed: 84 one-chunk requests from the only holder, with 1,000 empty peers beside it."""
    calls = 0
    real = swarm.PeerView.holds

    def counted(self, chunk: int) -> bool:
        nonlocal calls
        calls += 1
        return real(self, chunk)

    plan = plan_of(84, {"seed": None, **{f"m{i}": set() for i in range(1000)}})
    monkeypatch.setattr(swarm.PeerView, "holds", counted)
    while plan.needed:
        for request in swarm.plan_requests(plan, now=0.0, window=1, max_run=1):
            for c in request.chunks:
                swarm.chunk_verified(plan, c, request)
            swarm.finish(plan, request, 0.0)
    assert calls < 84 * 84, f"{calls} holds() calls: planning walks the peers that hold nothing"


def test_a_pull_naming_a_peer_asks_it_first_and_at_most_swarm_peers_of_the_known_others() -> None:
    """A node knowing a thousand members does not put them all in one pull (each would be polled every 0.5-2 s): the
    named peer, then the known others as they are when few, else a sample of SWARM_PEERS, different per puller."""
    few = ["b:1", "a:1", "b:1", "c:1"]
    assert swarm.swarm_peers("a:1", few) == ["a:1", "b:1", "c:1"]
    members = [f"m{i}:1" for i in range(1000)]
    samples = [swarm.swarm_peers("m7:1", members, random.Random(seed)) for seed in range(3)]
    for peers in samples:
        assert peers[0] == "m7:1" and len(peers) == 1 + swarm.SWARM_PEERS and len(set(peers)) == len(peers)
        assert set(peers) <= set(members)
    assert len({tuple(p) for p in samples}) == 3, "every puller of a rollout draws its own sample"


def test_random_order_differs_between_nodes() -> None:
    # Two nodes asking one seeder, and each other, start at different chunks, so they soon have something to trade
    # (a plan of one source has no one to trade with: it asks in file order, below).
    firsts = {swarm.plan_requests(plan_of(64, {"seed": None, "other": set()}, seed=s), now=0.0, window=1)[0].chunks[0] for s in range(8)}
    assert len(firsts) > 1


def test_runs_are_consecutive_chunks_the_peer_holds() -> None:
    plan = plan_of(10, {"p": {2, 3, 4, 7}})
    (request,) = swarm.plan_requests(plan, now=0.0, window=1, max_run=8)
    assert request.chunks in ([2, 3, 4], [3, 4], [4], [7])
    assert request.chunks == list(range(request.chunks[0], request.chunks[-1] + 1))


def test_run_length_spreads_small_adapters_and_caps_large_ones() -> None:
    assert swarm.run_length(4096, 60, peers=3, window=2) == 2  # 60 chunks over 6 slots, each four times over: short runs
    assert swarm.run_length(1 << 20, 64, peers=16) == 1  # a rollout's first copies spread one chunk at a time
    assert swarm.run_length(1 << 20, 81, peers=1) == 27  # one peer: runs of up to RUN_BYTES, equal (3 calls, not 81)
    assert swarm.run_length(4096, 100_000, peers=1) == 7693 <= swarm.RUN_BYTES // 4096  # capped by bytes: 13 calls
    assert swarm.run_length(1 << 20, 84, peers=1, window=2) == 21  # two streams: 4 calls, two at a time
    assert swarm.run_length(1 << 20, 40, peers=1, window=2) == 20


def test_a_plan_from_one_source_asks_for_the_file_in_order() -> None:
    plan = plan_of(17, {"seed": None})
    assert [r.chunks for r in swarm.plan_requests(plan, now=0.0, window=2, max_run=9)] == [list(range(9)), list(range(9, 17))]


def test_a_pull_from_one_source_keeps_two_requests_outstanding_unless_told_otherwise() -> None:
    assert swarm.window_for(1) == swarm.ONE_SOURCE_WINDOW == 2  # the passes of each chunk run on two cores
    assert swarm.window_for(2) == swarm.window_for(16) == swarm.WINDOW == 1  # a swarm has a stream per peer already
    assert swarm.window_for(1, 1) == 1 and swarm.window_for(16, 3) == 3  # a set window is kept as it is
    assert swarm.window_for(1, several=False) == 1  # a source that refused a second stream of ours lately


def test_verified_chunks_are_never_asked_for() -> None:
    plan = plan_of(4, {"seed": None}, verified={0, 1, 3})
    made = swarm.plan_requests(plan, now=0.0, window=4, max_run=4)
    assert [r.chunks for r in made] == [[2]]


def test_a_dead_peer_s_chunks_go_to_the_others() -> None:
    plan = plan_of(4, {"a": None, "b": None})
    made = swarm.plan_requests(plan, now=0.0, window=2, max_run=1)
    lost = [r for r in made if r.peer == "a"]
    swarm.mark_dead(plan, "a")
    for r in lost:
        swarm.finish(plan, r)
    for r in made:
        if r.peer == "b":
            for c in r.chunks:
                swarm.chunk_verified(plan, c)
            swarm.finish(plan, r, now=0.1)
    again = swarm.plan_requests(plan, now=0.2, window=2, max_run=1)
    assert {r.peer for r in again} == {"b"}
    assert sorted(c for r in again for c in r.chunks) == sorted(c for r in lost for c in r.chunks)


def test_endgame_duplicates_a_slow_request_once_then_cancels_the_loser() -> None:
    plan = plan_of(2, {"slow": None, "fast": None})
    first = swarm.plan_requests(plan, now=0.0, window=1, max_run=1)
    fast = next(r for r in first if r.peer == "fast")
    slow = next(r for r in first if r.peer == "slow")
    swarm.chunk_verified(plan, fast.chunks[0])
    swarm.finish(plan, fast, now=0.05)
    # Nothing fresh is left; the slow request is young: no duplicate yet.
    assert swarm.plan_requests(plan, now=0.1, window=1) == []
    late = swarm.ENDGAME_MIN_S + 0.5
    (dup,) = swarm.plan_requests(plan, now=late, window=2)
    assert dup.endgame and dup.peer == "fast" and dup.chunks == slow.chunks
    assert swarm.plan_requests(plan, now=late + 5, window=2) == []  # one duplicate per chunk
    swarm.chunk_verified(plan, dup.chunks[0])
    assert swarm.redundant(plan) == [slow, dup] or set(r.id for r in swarm.redundant(plan)) == {slow.id, dup.id}


def test_a_request_that_delivered_every_chunk_itself_is_left_to_read_its_end() -> None:
    plan = plan_of(4, {"a": None, "b": None})
    first = swarm.plan_requests(plan, now=0.0, window=1, max_run=1)
    done, other = first
    swarm.chunk_verified(plan, done.chunks[0], done)  # its own chunk: only its END (the peer's holdings) is left to read
    assert swarm.redundant(plan) == [], "a cancel there costs the kept connection and the END's holdings"
    swarm.retarget(plan, other, done.chunks)  # the other peer picked the same chunk (a substitute): that copy lost
    assert swarm.redundant(plan) == [other]


def test_endgame_waits_longer_when_requests_are_slow() -> None:
    plan = plan_of(2, {"a": None})
    plan.durations.extend([2.0] * 5)
    assert swarm.endgame_after(plan) == pytest.approx(2.0 * swarm.ENDGAME_FACTOR)


def test_a_peer_that_lost_chunks_is_not_asked_for_them_again() -> None:
    plan = plan_of(3, {"p": None})
    swarm.forget_chunks(plan, "p", [1])
    made = swarm.plan_requests(plan, now=0.0, window=3, max_run=1)
    assert sorted(c for r in made for c in r.chunks) == [0, 2]


def test_busy_peer_is_skipped_until_it_may_be_asked_again() -> None:
    plan = plan_of(3, {"p": None})
    plan.peers["p"].resume_at = 1.0
    assert swarm.plan_requests(plan, now=0.5, window=1) == []
    assert len(swarm.plan_requests(plan, now=1.0, window=1)) == 1


def test_super_seeding_hands_out_each_chunk_once_before_any_twice() -> None:
    sent = [0] * 8
    rng = random.Random(3)
    got = [swarm.pick_chunks([0], range(8), lambda c: True, sent, rng)[0] for _ in range(8)]
    assert sorted(got) == list(range(8))  # everyone asked for chunk 0; each got a different one
    assert sent == [1] * 8
    assert swarm.pick_chunks([5, 6], range(8), lambda c: True, sent, rng) == [5, 6]  # all tied: what was asked


def test_super_seeding_picks_only_held_and_accepted_chunks() -> None:
    sent = [0] * 8
    held = {1, 2, 6}
    picked = swarm.pick_chunks([0, 3, 4], {0, 2, 3, 6}, held.__contains__, sent, random.Random(1))
    assert sorted(picked) == [2, 6]  # chunk 1 is held but not accepted; fewer than asked when nothing else fits
    assert swarm.pick_chunks([0], set(), held.__contains__, sent, random.Random(1)) == []


def test_substitutes_exclude_chunks_other_requests_carry() -> None:
    plan = plan_of(6, {"a": None, "b": None})
    first, second = swarm.plan_requests(plan, now=0.0, window=1)[:2]
    assert swarm.substitutes(plan, first) == frozenset(plan.needed) - {second.chunks[0]}
    single = plan_of(6, {"a": None})
    assert swarm.substitutes(single, swarm.plan_requests(single, now=0.0, window=1)[0]) == frozenset()


def test_bitmap_round_trip_lsb_first() -> None:
    assert swarm.chunks_to_bitmap({0, 9}, 10) == bytes([0b00000001, 0b00000010])
    assert swarm.bitmap_to_chunks(bytes([0b00000001, 0b00000010]), 10) == {0, 9}
    assert swarm.bitmap_to_chunks(b"\xff\xff", 10) == set(range(10))  # bits past the count are ignored


# ------------------------------------------------------------ discovery


def test_dns_name_resolves_to_peer_addresses_and_leaves_this_node_out() -> None:
    found = resolve("localhost:50077")
    assert "127.0.0.1:50077" in found
    source = PeerSource(static=("10.0.0.9:1",), dns="localhost:50077", me="127.0.0.1:50077")
    assert source.peers()[0] == "10.0.0.9:1"
    assert "127.0.0.1:50077" not in source.peers()
    with pytest.raises(InvalidArgument, match="host:port"):
        PeerSource(dns="no-port-here")


# ------------------------------------------------------------ real nodes


@pytest.fixture(scope="module")
def big_adapter(tmp_path_factory) -> Path:
    # ~128 KiB: 4 KiB chunks make ~30 chunks, and rate-limited seeders make a pull last seconds.
    return make_peft_adapter(tmp_path_factory.mktemp("adapters") / "big", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=ALL, seed=5)


def weights_root(adapter: Path) -> str:
    """The weights file's root at the swarm nodes' chunk size (its blob's name in a store)."""
    return hash_file("adapter_model.safetensors", adapter / "adapter_model.safetensors", int(SMALL_CHUNK[1])).root


def store_node(root: Path, name: str, *, rate: int = 0, peers=(), extra=()) -> LocalNode:
    args = [*SMALL_CHUNK, *(["--upload-rate", str(rate)] if rate else []), *extra]
    return LocalNode(root / name, model="none", port=free_port(), peers=peers, extra_args=args)


def start_all(nodes: list[LocalNode]) -> None:
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()


def verified_count(client: NodeClient, digest: str) -> int:
    try:
        reply = client.availability(digest)
    except AdapterNotFound:
        return 0
    return reply.chunk_count if reply.complete else len(swarm.bitmap_to_chunks(reply.verified_bitmap, reply.chunk_count))


@pytest.mark.slow
def test_pull_from_three_peers_one_dies_midway(tmp_path, big_adapter) -> None:
    seeds = [store_node(tmp_path, f"seed{i}", rate=12 << 10) for i in range(2)] + [store_node(tmp_path, "seed2")]
    start_all(seeds)
    # The third peer is a relay in front of seed2: it serves exactly two chunks, then holds until the test kills it.
    relay = GatedRelay(seeds[2].address, hold_after=2)
    puller = store_node(tmp_path, "puller", peers=[seeds[1].address, relay.address]).start()
    try:
        for seed in seeds:
            with NodeClient(seed.address) as client:
                digest = client.stage(big_adapter, "big").digest
                count = client.manifest("big").files[-1].chunk_count
        with NodeClient(puller.address) as client:
            result: dict = {}
            pulling = threading.Thread(target=lambda: result.update(reply=client.promote("big", peer=seeds[0].address, stage_only=True)))
            pulling.start()
            relay.wait_holding()  # the pull is under way and the third peer has served its two chunks
            relay.kill()
            still_missing = verified_count(client, digest) < count
            pulling.join(120)
            reply = result["reply"]
            staged = {a.adapter_id: a for a in client.list().staged}
        assert still_missing, "the peer should die while chunks were still missing"
        assert reply.digest == digest and staged["big"].digest == digest
        sources = reply.source_peer.split(",")
        assert relay.address in sources, "the dead peer served chunks before it died"
        assert len(sources) == 3
        # The committed bytes are the staged file's bytes.
        blob = next(puller.store.rglob(weights_root(big_adapter)))
        assert blob.read_bytes() == (big_adapter / "adapter_model.safetensors").read_bytes()
    finally:
        relay.kill()
        for node in (*seeds, puller):
            node.stop()


@pytest.mark.slow
def test_partial_holder_serves_only_verified_chunks(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed").start()
    middle = store_node(tmp_path, "middle", extra=["--stall-timeout", "120"]).start()  # held below while the test probes
    relay = GatedRelay(seed.address, hold_after=3)  # the middle node's pull stops after exactly three chunks
    try:
        with NodeClient(seed.address) as client:
            staged = client.stage(big_adapter, "big")
            manifest = client.manifest("big")
        weights = next(f for f in manifest.files if f.name == "adapter_model.safetensors")
        count = weights.chunk_count
        with NodeClient(middle.address) as client, grpc.insecure_channel(middle.address) as channel:
            outcome: list = []

            def pull() -> None:
                try:
                    outcome.append(client.promote("big", peer=relay.address, stage_only=True, named_peer_only=True))
                except Exception as exc:  # the relay is killed once the probe is done
                    outcome.append(exc)

            pulling = threading.Thread(target=pull)
            pulling.start()
            relay.wait_holding()
            while verified_count(client, staged.digest) < 3:  # sent, hence soon verified; no more can come
                time.sleep(0.05)
            fetch = wire.fetch_stub(channel)
            served, refused = [], []
            for index in range(count):
                request = fabric_pb2.FetchRequest(digest=staged.digest, offset=index * weights.chunk_size, length=weights.chunk_size)
                try:
                    chunks = list(fetch(request, timeout=30))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
                    assert "not verified on this node" in exc.details()
                    refused.append(index)
                    continue
                assert [offset for offset, _ in chunks] == [index * weights.chunk_size]
                assert chunk_digest(chunks[0][1]) == weights.chunk_digests[index]
                served.append(index)
            # The stream's trailer says what the node holds by now: a puller need not poll Availability for it.
            call = fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=served[0] * weights.chunk_size, length=weights.chunk_size), timeout=30)
            assert len(list(call)) == 1
            bitmap, complete = fetch_metadata.holding(call.trailing_metadata())
            assert not complete and bitmap is not None and set(served) <= swarm.bitmap_to_chunks(bitmap, count)
            with grpc.insecure_channel(seed.address) as seed_channel:
                from_seed = wire.fetch_stub(seed_channel)(fabric_pb2.FetchRequest(digest=staged.digest, length=weights.chunk_size), timeout=30)
                assert len(list(from_seed)) == 1
                assert fetch_metadata.holding(from_seed.trailing_metadata()) == (None, True)
            # A range reaching past the verified chunks is refused whole, before a byte is sent.
            with pytest.raises(grpc.RpcError) as whole:
                list(fetch(fabric_pb2.FetchRequest(digest=staged.digest), timeout=30))
            assert whole.value.code() == grpc.StatusCode.NOT_FOUND
            # A swarm request (accept_bitmap) for a chunk it lacks gets verified substitutes instead.
            accept = swarm.chunks_to_bitmap(range(count), count)
            substituted = list(fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=refused[-1] * weights.chunk_size, length=2 * weights.chunk_size, accept_bitmap=accept), timeout=30))
            availability = client.availability(staged.digest)
            held = swarm.bitmap_to_chunks(availability.verified_bitmap, count)
            assert 1 <= len(substituted) <= 2
            for offset, data in substituted:
                index = offset // weights.chunk_size
                assert index in held and chunk_digest(data) == weights.chunk_digests[index]
            relay.kill()  # no need to wait for the rest
            pulling.join(60)
        assert served and refused, f"mid-pull the node should hold some chunks and miss others (served {served}, refused {refused})"
        assert not availability.complete
    finally:
        relay.kill()
        seed.stop()
        middle.stop()


@pytest.mark.slow
def test_rollout_cli_forms_a_pipeline_and_locate_finds_holders(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed", rate=32 << 10)
    ports = [free_port() for _ in range(3)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    traces = tmp_path / "traces"
    traces.mkdir()
    nodes = [
        LocalNode(tmp_path / f"n{i}", model="none", port=port, peers=[a for a in addresses if a != addresses[i]], extra_args=SMALL_CHUNK,
                  env={TRACE_ENV: str(traces)})
        for i, port in enumerate(ports)
    ]
    start_all([seed, *nodes])
    # A fifth node knows its peers only through a DNS name (localhost resolves to the seed's address).
    finder = store_node(tmp_path, "finder", extra=["--peers-dns", f"localhost:{seed.address.rsplit(':', 1)[1]}"]).start()
    try:
        with NodeClient(seed.address) as client:
            digest = client.stage(big_adapter, "big").digest
        out = subprocess.run(
            [sys.executable, "-m", "adapter_fabric.cli", "rollout", *addresses, "--id", "big", "--from", seed.address, "--stage-only", "--json"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert [r["node"] for r in report["nodes"]] == addresses
        assert all(r["ok"] and r["digest"] == digest and r["seconds"] > 0 for r in report["nodes"])
        assert report["slowest_seconds"] == max(r["seconds"] for r in report["nodes"])
        # A pipeline, not a star: some node received chunks from another node than the seed.
        assert any(set(r["source_peers"]) - {seed.address} for r in report["nodes"]), report
        # Nodes pulling it together learnt what each other held from their Fetch exchanges: a peer's request
        # to a node carried the peer's holdings ("hint"), a stream's trailer the server's ("held").
        events = [e for trace in traces.glob("pull-*.json") for e in json.loads(trace.read_text())["events"]]
        assert any(kind == "hint" and peer in addresses for _, kind, peer, _ in events), "no request carried its sender's holdings"
        assert any(kind == "held" and peer in addresses for _, kind, peer, _ in events), "no trailer told a puller what its peer held"
        with NodeClient(addresses[0]) as client:
            located = client.locate("big")
        assert located.digest == digest
        assert {h.address for h in located.peers} == set(addresses[1:]) and all(h.complete for h in located.peers)
        with NodeClient(finder.address) as client:
            assert [(h.address, h.complete) for h in client.locate("big").peers] == [(seed.address, True)]
    finally:
        for node in (seed, *nodes, finder):
            node.stop()


@pytest.mark.slow
def test_seed_hands_out_each_chunk_once_then_sends_swarm_callers_elsewhere(tmp_path, big_adapter) -> None:
    seed = store_node(tmp_path, "seed", rate=8 << 10).start()  # 2 chunks a second: a stream stays open for seconds
    try:
        with NodeClient(seed.address) as client:
            staged = client.stage(big_adapter, "big")
            manifest = client.manifest("big")
        weights = next(f for f in manifest.files if f.name == "adapter_model.safetensors")
        count, size = weights.chunk_count, weights.chunk_size
        every = swarm.chunks_to_bitmap(range(count), count)
        with grpc.insecure_channel(seed.address) as channel:
            fetch = wire.fetch_stub(channel)
            # A swarm caller asking for chunk 0 while other chunks were never handed out gets them instead, one each.
            firsts = [next(iter(fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=0, length=size, accept_bitmap=every), timeout=30)))[0] // size for _ in range(3)]
            assert len(set(firsts)) == 3
            # One stream takes every remaining chunk: their first copies are on their way ...
            rest = [c for c in range(count) if c not in firsts]
            slow = fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=rest[0] * size, length=size * len(rest), accept_bitmap=swarm.chunks_to_bitmap(rest, count)), timeout=60)
            next(iter(slow))
            # ... so a swarm caller is sent elsewhere, while a plain Fetch is served as ever.
            with pytest.raises(grpc.RpcError) as busy:
                list(fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=0, length=size, accept_bitmap=every), timeout=30))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_from_rpc(busy.value).bound == FIRST_COPIES_BOUND  # a puller's data channel keeps to the channel for it
            assert [o for o, _ in fetch(fabric_pb2.FetchRequest(digest=staged.digest, offset=0, length=size), timeout=30)] == [0]
            slow.cancel()
    finally:
        seed.stop()


def test_a_peer_that_refused_a_stream_beside_ours_is_asked_no_more_than_it_took() -> None:
    plan = plan_of(40, {"seed": None})
    first = swarm.plan_requests(plan, now=0.0, window=2, max_run=10)
    assert len(first) == 2 and all(r.beside for r in first)  # several at once: a busy refusal is not sent to gRPC
    swarm.finish(plan, first[1])  # refused: the peer took one
    plan.peers["seed"].cap = 1
    assert swarm.plan_requests(plan, now=0.0, window=2, max_run=10) == []  # its cap is in flight
    swarm.finish(plan, first[0])
    (alone,) = swarm.plan_requests(plan, now=0.0, window=2, max_run=10)
    assert not alone.beside
    assert not any(r.beside for r in swarm.plan_requests(plan_of(40, {"a": None, "b": None}), now=0.0, window=1, max_run=10))


@pytest.mark.slow
@pytest.mark.parametrize("channel", ["data channel", "gRPC"])
def test_a_pull_naming_the_only_holder_beside_an_idle_member_takes_long_runs(tmp_path, big_adapter, channel) -> None:
    """The seeder says, in each pick, that nobody else pulls the adapter from it (``recent_pullers``), on either channel:
    the puller leaves the swarm's pace (runs of 3 of the ~30 chunks, beside one member) for a lone pull's."""
    extra = ["--data-port", "off"] if channel == "gRPC" else []
    seed = store_node(tmp_path, "seed", extra=extra)
    member = store_node(tmp_path, "member", extra=extra)
    start_all([seed, member])
    traces = tmp_path / "traces"
    traces.mkdir()
    puller = store_node(tmp_path, "puller", peers=[seed.address, member.address], extra=extra)
    puller.env = {TRACE_ENV: str(traces)}
    puller.start()
    try:
        with NodeClient(seed.address) as client:
            digest = client.stage(big_adapter, "big").digest
            count = client.manifest("big").files[-1].chunk_count
        with NodeClient(puller.address) as client:
            reply = client.promote("big", peer=seed.address, stage_only=True)
        assert reply.digest == digest
        (trace,) = traces.glob("pull-*.json")
        pulled = json.loads(trace.read_text())
        assert pulled["peers"] == [seed.address, member.address]
        runs = [chunks for _, kind, peer, chunks in pulled["events"] if kind == "start"]
        assert max(map(len, runs)) > swarm.run_length(4096, count, 2) and len(runs) < count / 3, runs
    finally:
        for node in (seed, member, puller):
            node.stop()
