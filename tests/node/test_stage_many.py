"""Issue 34: StageMany, many small adapters published on one stream and committed in groups, with real node processes
and real PEFT adapters (``adapter_fabric.node.stage_many``, ``adapter_fabric.client.stage_stream``).

One call for a batch (the node's own RPC metrics), the digests a single Stage gives; bad adapters in the middle refused by
name while the others commit; a policy refusal per adapter; every adapter answered committed survives a SIGKILL; a node
without StageMany (a proxy answering UNIMPLEMENTED) gets the per-adapter Stage path; a stream cut mid-batch is sent again
for the unanswered adapters, each answered once; the bounds (a too large adapter, streams in flight).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client import stage_stream
from adapter_fabric.client.stage_stream import stage_many_request
from adapter_fabric.errors import BadSignature, Busy, IntegrityError, InvalidAdapterId, InvalidArgument, PermissionDenied, Unauthenticated
from adapter_fabric.harness.bench import make_small_adapters
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.node.stage_many import MAX_ADAPTER_BYTES, MAX_STREAMS
from adapter_fabric.rpc import security
from adapter_fabric.rpc.status import error_from_detail, error_from_rpc
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.digests import CONFIG_FILE, adapter_digest, hash_bytes
from adapter_fabric.trust.signing import keygen, sign, signatures_from_proto
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHUNK = 1 << 20  # the nodes' default chunk size


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[Path]:
    return make_small_adapters(tmp_path_factory.mktemp("many"), 120)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with LocalNode(tmp_path_factory.mktemp("node") / "n", model="none", extra_args=["--metrics-listen", "127.0.0.1:0"]) as running:
        yield running


def calls(node: LocalNode, method: str) -> float:
    return scrape(node).get(("fabric_rpc_duration_seconds_count", frozenset({("method", method)})), 0.0)


def stub_of(node: LocalNode, token: str | None = None) -> fabric_pb2_grpc.FabricStub:
    return fabric_pb2_grpc.FabricStub(security.channel(node.address, token=token))


def answers(results) -> dict[str, object]:
    """adapter id -> its StageResponse, or the library error its refusal names."""
    return {r.adapter_id: r.staged if r.HasField("staged") else error_from_detail(r.error.SerializeToString()) for r in results}


def test_a_batch_of_small_adapters_is_one_stage_many_call_with_the_digests_a_stage_gives(node, adapters) -> None:
    items = [(d, f"one/{d.name}") for d in adapters[:80]]
    stages, many = calls(node, "Stage"), calls(node, "StageMany")
    seen: list[str] = []
    with node.client() as c:
        result = c.stage_many(items, on_done=lambda adapter_id, ok, error: seen.append(adapter_id))
        assert result.ok and [r.adapter_id for r in result.staged] == [i for _, i in items]
        assert sorted(seen) == sorted(i for _, i in items)  # each answered once
        assert calls(node, "StageMany") == many + 1 and calls(node, "Stage") == stages  # one stream, no Stage call
        for staged, directory in zip(result.staged[:5], adapters[:5], strict=True):
            assert c.stage(directory, f"alone/{directory.name}").digest == staged.digest  # the digest a Stage of its own gives
        assert len({r.digest for r in result.staged}) == len(items)


def test_bad_adapters_in_the_middle_are_refused_by_name_and_the_others_commit(node, adapters, tmp_path) -> None:
    good = adapters[80:90]
    requests = [stage_many_request(d, f"mixed/{d.name}", CHUNK) for d in good]
    requests[2].digest = "ab" * 32  # a lying digest
    requests[4].begin.adapter_id = "../escape"  # a bad id
    requests[6].begin.config_json = json.dumps({"peft_type": "LORA", "r": -4}).encode()  # a config the node refuses
    requests[6].digest = adapter_digest(hash_bytes(CONFIG_FILE, requests[6].begin.config_json, CHUNK).root, requests[6].begin.weights_root)
    requests[8].data = requests[8].data[:-1]  # fewer bytes than declared
    got = answers(stub_of(node).StageMany(iter(requests), timeout=120))
    assert list(got) == [r.begin.adapter_id for r in requests]  # every adapter answered, in order
    assert isinstance(got[requests[2].begin.adapter_id], IntegrityError) and "declared digest" in str(got[requests[2].begin.adapter_id])
    assert isinstance(got["../escape"], InvalidAdapterId)
    assert isinstance(got[requests[6].begin.adapter_id], InvalidArgument)
    assert isinstance(got[requests[8].begin.adapter_id], InvalidArgument) and "declared" in str(got[requests[8].begin.adapter_id])
    committed = {i for i, answer in got.items() if isinstance(answer, fabric_pb2.StageResponse)}
    assert committed == {r.begin.adapter_id for n, r in enumerate(requests) if n not in (2, 4, 6, 8)}
    with node.client() as c:
        listed = {a.adapter_id for a in c.list().staged}
    assert committed <= listed and not {r.begin.adapter_id for n, r in enumerate(requests) if n in (2, 4, 6, 8)} & listed


def test_signed_adapters_keep_their_signature_and_a_false_one_is_refused_by_name(node, adapters) -> None:
    key = keygen()[0]
    requests = [stage_many_request(d, f"signed/{d.name}", CHUNK) for d in adapters[110:113]]
    good = sign(key, requests[0].digest)
    requests[0].begin.signature, requests[0].begin.signer_public_key = good.signature, good.public_key
    false = sign(key, "00" * 32)  # a signature, but not over this adapter's digest
    requests[1].begin.signature, requests[1].begin.signer_public_key = false.signature, false.public_key
    got = answers(stub_of(node).StageMany(iter(requests), timeout=60))
    assert isinstance(got[requests[0].begin.adapter_id], fabric_pb2.StageResponse)
    assert isinstance(got[requests[1].begin.adapter_id], BadSignature)
    assert isinstance(got[requests[2].begin.adapter_id], fabric_pb2.StageResponse)  # the one after it, unsigned, commits
    with node.client() as c:
        assert {s.public_key for s in signatures_from_proto(c.manifest_proto(requests[0].begin.adapter_id))} == {good.public_key}
        assert requests[1].begin.adapter_id not in {a.adapter_id for a in c.list().staged}


def test_the_bounds_an_adapter_too_large_and_streams_past_the_node_limit(node, adapters) -> None:
    big = stage_many_request(adapters[90], "bounds/big", CHUNK)
    big.data = b"\0" * (MAX_ADAPTER_BYTES + 1)
    big.begin.safetensors_size = len(big.data)
    ok = stage_many_request(adapters[91], "bounds/ok", CHUNK)
    got = answers(stub_of(node).StageMany(iter([big, ok]), timeout=60))
    assert isinstance(got["bounds/big"], InvalidArgument) and "stage it with Stage" in str(got["bounds/big"])
    assert isinstance(got["bounds/ok"], fabric_pb2.StageResponse)
    # MAX_STREAMS streams held open, each answered once (so the node runs it), then one more is refused Busy by name.
    gates = [queue.Queue() for _ in range(MAX_STREAMS)]
    held = []
    for n, gate in enumerate(gates):
        gate.put(stage_many_request(adapters[92 + n], f"bounds/held-{n}", CHUNK))
        replies = stub_of(node).StageMany(iter(gate.get, None), timeout=60)
        assert next(replies).HasField("staged")
        held.append(replies)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            list(stub_of(node).StageMany(iter([stage_many_request(adapters[99], "bounds/one-more", CHUNK)]), timeout=60))
        error = error_from_rpc(refused.value)
        assert isinstance(error, Busy) and f"({MAX_STREAMS})" in str(error), error
    finally:
        for gate in gates:
            gate.put(None)
        for replies in held:
            assert list(replies) == []
    with node.client() as c:  # a stream ended frees its place
        assert c.stage_many([(adapters[99], "bounds/after")]).ok


def test_a_principal_is_refused_per_adapter_and_its_others_commit(tmp_path, adapters) -> None:
    (tmp_path / "cluster.token").write_text("cluster-token-5c1e")
    (tmp_path / "policy.toml").write_text(f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256('team-a-token-77b0')}"
grants = [{{ verbs = ["read", "publish"], prefixes = ["team-a/"] }}]

[[principal]]
name = "reader"
token_sha256 = "{token_sha256('reader-token-0d93')}"
grants = [{{ verbs = ["read"], prefixes = ["*"] }}]
""")
    args = ["--policy", str(tmp_path / "policy.toml"), "--metrics-listen", "127.0.0.1:0"]
    with LocalNode(tmp_path / "n", model="none", token_file=tmp_path / "cluster.token", extra_args=args) as node:
        items = [(d, f"team-a/{d.name}") for d in adapters[100:104]] + [(adapters[104], "team-b/theirs"), (adapters[105], "team-a/last")]
        with node.client(token="team-a-token-77b0") as c:
            result = c.stage_many(items)
        assert [f.adapter_id for f in result.failed] == ["team-b/theirs"]
        assert isinstance(result.failed[0].error, PermissionDenied) and "publish" in str(result.failed[0].error)
        assert [r.adapter_id for r in result.staged] == [i for _, i in items if i != "team-b/theirs"]
        with node.client(token="reader-token-0d93") as c:  # no publish anywhere: refused at its UploadOffset, every adapter named
            refused = c.stage_many([(adapters[106], "team-a/by-reader"), (adapters[107], "team-a/by-reader-2")])
        assert [type(f.error) for f in refused.failed] == [PermissionDenied, PermissionDenied]
        with pytest.raises(grpc.RpcError) as gated:  # and a stream it opens is refused by the gate before a message is read
            list(stub_of(node, "reader-token-0d93").StageMany(iter([stage_many_request(adapters[106], "team-a/by-reader", CHUNK)]), timeout=60))
        assert isinstance(error_from_rpc(gated.value), PermissionDenied) and "'publish' on every prefix" in str(error_from_rpc(gated.value))
        with node.client() as c:
            assert {a.adapter_id for a in c.list().staged} == {r.adapter_id for r in result.staged}
        assert calls(node, "StageMany") == 2 and calls(node, "Stage") == 0  # team-a's one stream, and the reader's refused one
        # One audit line per adapter, as a Stage has (was: one line for the batch, naming only its first id)
        audited = [line for line in node.log_path.read_text(errors="replace").splitlines() if "fabric.audit" in line and "action=stage " in line]
        for staged in result.staged:
            assert sum(f"adapter={staged.adapter_id} " in line and f"digest={staged.digest} " in line and "principal=team-a " in line
                       and "outcome=ok" in line for line in audited) == 1, (staged.adapter_id, audited)
        assert sum("adapter=team-b/theirs " in line and "outcome=refused" in line for line in audited) == 1, audited


def team_a_policy(verbs: list[str], *, other: bool = False) -> str:
    text = f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256('team-a-token-77b0')}"
grants = [{{ verbs = {json.dumps(verbs)}, prefixes = ["team-a/"] }}]
"""
    return text + (f"""
[[principal]]
name = "other"
token_sha256 = "{token_sha256('other-token-41aa')}"
grants = [{{ verbs = ["read"], prefixes = ["other/"] }}]
""" if other else "")


def reload_policy(node: LocalNode, path: Path, text: str, in_force: Callable[[], bool]) -> None:
    """Write the policy, SIGHUP the node, and wait until ``in_force`` says the node reads it."""
    path.write_text(text)
    os.kill(node.pid, signal.SIGHUP)
    wait_for(in_force, timeout=30, what="the new policy in force")


def test_a_policy_reload_ends_an_open_stream_and_a_revocation_refuses_it(tmp_path, adapters) -> None:
    """A stream's adapters are checked under the principal it opened with: past a reload the stream ends (Busy: the client
    sends the rest on a new stream, checked under the new policy), and a caller that lost publish is refused."""
    (tmp_path / "cluster.token").write_text("cluster-token-5c1e")
    policy = tmp_path / "policy.toml"
    policy.write_text(team_a_policy(["read", "publish"]))
    with LocalNode(tmp_path / "n", model="none", token_file=tmp_path / "cluster.token", extra_args=["--policy", str(policy)]) as node:
        gate: queue.Queue = queue.Queue()
        replies = stub_of(node, "team-a-token-77b0").StageMany(iter(gate.get, None), timeout=60)
        gate.put(stage_many_request(adapters[110], "team-a/before", CHUNK))
        assert next(replies).HasField("staged")

        def whoami(token: str) -> list[str]:
            with node.client(token=token) as c:
                return sorted(v for g in c.whoami().grants for v in g.verbs)

        def other_known() -> bool:
            try:
                return whoami("other-token-41aa") == ["read"]
            except Unauthenticated:
                return False

        reload_policy(node, policy, team_a_policy(["read", "publish"], other=True), other_known)  # team-a unchanged
        gate.put(stage_many_request(adapters[111], "team-a/after-reload", CHUNK))
        with pytest.raises(grpc.RpcError) as ended:
            next(replies)
        assert isinstance(error_from_rpc(ended.value), Busy) and "policy changed" in str(error_from_rpc(ended.value))
        gate.put(None)

        gate = queue.Queue()
        replies = stub_of(node, "team-a-token-77b0").StageMany(iter(gate.get, None), timeout=60)
        gate.put(stage_many_request(adapters[111], "team-a/after-reload", CHUNK))
        assert next(replies).HasField("staged")  # a new stream, under the new policy
        reload_policy(node, policy, team_a_policy(["read"]), lambda: whoami("team-a-token-77b0") == ["read"])
        gate.put(stage_many_request(adapters[112], "team-a/revoked", CHUNK))
        with pytest.raises(grpc.RpcError) as refused:
            next(replies)
        assert isinstance(error_from_rpc(refused.value), PermissionDenied)
        gate.put(None)
        with node.client() as c:
            assert {a.adapter_id for a in c.list().staged} == {"team-a/before", "team-a/after-reload"}


def test_every_adapter_answered_committed_survives_a_sigkill(tmp_path, adapters) -> None:
    node = LocalNode(tmp_path / "n", model="none").start()
    requests = [stage_many_request(d, f"kill/{d.name}", CHUNK) for d in adapters[:100]]
    answered: list[fabric_pb2.StageResponse] = []
    try:
        for result in stub_of(node).StageMany(iter(requests), timeout=120):
            answered.append(result.staged)
            if len(answered) == 40:
                node.kill()  # right after the 40th answer
                break
    except grpc.RpcError:
        pass
    assert len(answered) == 40
    node.start()
    try:
        with node.client() as c:
            listed = {a.adapter_id: a.digest for a in c.list().staged}
    finally:
        node.stop()
    assert {a.adapter_id: a.digest for a in answered}.items() <= listed.items()
    store = AdapterStore(tmp_path / "n")
    for adapter_id in listed:
        store.verify(adapter_id)
    assert not store.damaged()


class _Proxy(fabric_pb2_grpc.FabricServicer):
    """A node's Stage and UploadOffset forwarded; StageMany UNIMPLEMENTED (an older node), or forwarded with its first
    stream cut after ``cut_after`` answers (a connection lost mid-batch)."""

    def __init__(self, target: str, cut_after: int | None) -> None:
        self.stub = fabric_pb2_grpc.FabricStub(grpc.insecure_channel(target))
        self.cut_after = cut_after
        self.streams = 0

    def UploadOffset(self, request, context):
        return self.stub.UploadOffset(request)

    def Stage(self, request_iterator, context):
        return self.stub.Stage(request_iterator)

    def StageMany(self, request_iterator, context):
        if self.cut_after is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.streams += 1
        first = self.streams == 1
        for n, result in enumerate(self.stub.StageMany(request_iterator), 1):
            yield result
            if first and n == self.cut_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the proxy cut the stream")


def proxied(node: LocalNode, cut_after: int | None) -> tuple[grpc.Server, _Proxy, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    proxy = _Proxy(node.address, cut_after)
    fabric_pb2_grpc.add_FabricServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, proxy, f"127.0.0.1:{port}"


def test_a_node_without_stage_many_gets_one_stage_per_adapter(node, adapters) -> None:
    from adapter_fabric.client.node_client import NodeClient

    server, _, address = proxied(node, cut_after=None)
    before, stages = stage_stream.fallbacks(), calls(node, "Stage")
    try:
        items = [(d, f"old/{d.name}") for d in adapters[:12]]
        with NodeClient(address) as c:
            result = c.stage_many(items)
        assert result.ok and [r.adapter_id for r in result.staged] == [i for _, i in items]
        assert stage_stream.fallbacks() == before + 1 and calls(node, "Stage") == stages + len(items)
    finally:
        server.stop(0)


def test_a_stream_cut_mid_batch_is_sent_again_for_the_unanswered_each_answered_once(node, adapters) -> None:
    from adapter_fabric.client.node_client import NodeClient

    server, proxy, address = proxied(node, cut_after=7)
    lock = threading.Lock()
    seen: list[str] = []

    def done(adapter_id, ok, error) -> None:
        with lock:
            seen.append(adapter_id)

    try:
        items = [(d, f"cut/{d.name}") for d in adapters[:30]]
        with NodeClient(address) as c:
            result = c.stage_many(items, on_done=done)
        assert result.ok and [r.adapter_id for r in result.staged] == [i for _, i in items]
        assert sorted(seen) == sorted(i for _, i in items)  # nothing answered twice, nothing lost
        assert proxy.streams == 2
    finally:
        server.stop(0)
    with node.client() as c:
        listed = {a.adapter_id: a.digest for a in c.list().staged}
    assert all(listed[r.adapter_id] == r.digest for r in result.staged)
