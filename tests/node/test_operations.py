"""Operating a node, against real node processes: metrics, probes under mTLS, logs, drain, peers, store hygiene, status details."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import AdapterNotFound, PeerUnavailable, Unauthenticated
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.harness.node_forks import FORK_VARIABLE
from adapter_fabric.store.manifest import manifest_request
from adapter_fabric.rpc.security import TlsFiles
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

from adapter_fabric.transport import wire
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.store import stage_begin
from tests.support.certs import TestCA
from tests.support.scrape import http_get, scrape
from tests.support.waiting import wait_for

PROMPT = [3, 14, 15, 92, 65, 35]
SMALL_CHUNK = ["--chunk-size", "4096"]
METRICS = ["--metrics-listen", "127.0.0.1:0"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WAIT_S = 120.0  # a bound against hangs, never a speed assertion


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    return {
        "alpha": make_peft_adapter(root / "alpha", base_model=base, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
        # ~128 KiB: with 4 KiB chunks and a slow seeder, a Fetch lasts seconds
        "big": make_peft_adapter(root / "big", base_model=base, r=16, lora_alpha=16, target_modules=ALL, seed=5),
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)



# ---------------------------------------------------------------- metrics


@pytest.mark.slow
def test_metrics_move_after_a_stage_a_promote_from_a_peer_and_a_generate(tmp_path, adapters) -> None:
    with LocalNode(tmp_path / "a", model="none", extra_args=[*SMALL_CHUNK, *METRICS]) as a:  # the seeder needs no model
        with LocalNode(tmp_path / "b", peers=[a.address], extra_args=[*SMALL_CHUNK, *METRICS, "--metrics-adapter-labels"]) as b:
            assert http_get(b.metrics_address, "/healthz")[0] == 200
            assert http_get(b.metrics_address, "/readyz")[0] == 200
            before = scrape(b)
            assert value(before, "fabric_ready") == 1 and value(before, "fabric_slots") == 2 and value(before, "fabric_slots_filled") == 0

            with a.client() as ca, b.client() as cb:
                staged = ca.stage(adapters["alpha"], "alpha")
                promoted = cb.promote("alpha", peer=a.address)
                cb.pin("alpha")
                cb.generate(PROMPT, adapter="alpha", max_new_tokens=2)
                with pytest.raises(AdapterNotFound):
                    cb.promote("no-such-adapter", peer=a.address)

            seeder, puller = scrape(a), scrape(b)
            weights = (adapters["alpha"] / "adapter_model.safetensors").stat().st_size
            assert value(seeder, "fabric_stage_uploads_total", outcome="ok") == 1
            assert value(seeder, "fabric_stage_received_bytes_total") == weights
            assert value(seeder, "fabric_served_bytes_total") >= weights  # every chunk at least once
            assert value(seeder, "fabric_store_used_bytes") >= weights
            assert value(seeder, "fabric_rpc_duration_seconds_count", method="Stage") == 1

            assert value(puller, "fabric_promotes_total", outcome="ok") == 1
            assert value(puller, "fabric_promotes_total", outcome="AdapterNotFound") == 1
            assert value(puller, "fabric_promote_duration_seconds_count", outcome="ok") == 1
            assert value(puller, "fabric_pulls_total", outcome="ok") == 1
            assert value(puller, "fabric_pulls_total", outcome="AdapterNotFound") == 1
            assert value(puller, "fabric_pull_duration_seconds_count", outcome="ok") == 1
            assert value(puller, "fabric_pull_received_bytes_total", peer=a.address) == promoted.bytes_transferred > 0
            assert value(puller, "fabric_rpc_errors_total", method="Promote", code="NOT_FOUND") == 1
            assert value(puller, "fabric_generate_duration_seconds_count") == 1
            assert value(puller, "fabric_slots_filled") == 1 and value(puller, "fabric_slots_pinned") == 1
            assert value(puller, "fabric_slots_busy") == 0
            resident = [labels for (name, labels), v in puller.items() if name == "fabric_resident_adapter_info" and v == 1]
            assert len(resident) == 1 and ("adapter", "alpha") in resident[0] and ("content_id", f"{promoted.content_id:x}") in resident[0]
            assert value(puller, "fabric_store_used_bytes") >= weights
            assert value(puller, "fabric_build_info", version=__import__("adapter_fabric").__version__) == 1
            assert staged.digest == promoted.digest


# ---------------------------------------------------------------- probes under mTLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TlsFiles]:
    ca = TestCA(tmp_path_factory.mktemp("pki") / "ca")
    return {"node": ca.issue("node"), "no-cert": TlsFiles(ca=ca.cert_path)}


def _call_without_client_cert(channel: grpc.Channel, method: str, descriptor) -> grpc.StatusCode:
    path = f"/fabric.v1.Fabric/{method}"
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(descriptor.client_streaming, descriptor.server_streaming)]
    call = make(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    request = iter([b""]) if descriptor.client_streaming else b""
    try:
        result = call(request, timeout=30)
        if descriptor.server_streaming:
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
def test_probes_work_without_a_client_certificate_while_every_fabric_rpc_still_needs_one(tmp_path, pki) -> None:
    with LocalNode(tmp_path / "n", model="none", tls=TlsFiles(pki["node"].cert, pki["node"].key, pki["node"].ca), extra_args=METRICS) as node:
        assert http_get(node.metrics_address, "/healthz") == (200, "ok\n")
        assert http_get(node.metrics_address, "/readyz") == (200, "ready\n")
        assert http_get(node.metrics_address, "/metrics")[0] == 200
        assert http_get(node.metrics_address, "/store")[0] == 404
        credentials = pki["no-cert"].channel_credentials()  # trusts the node's CA, presents no certificate
        with grpc.secure_channel(node.address, credentials) as channel:
            service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]
            codes = {m.name: _call_without_client_cert(channel, m.name, m) for m in service.methods}
        assert set(codes) >= {"Stage", "Fetch", "Promote", "StoreStatus"}
        assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes  # the handshake fails: nothing is served
        with node.client() as client:  # with its certificate, the same node answers
            assert client.store_status().adapters == 0


@pytest.mark.slow
def test_a_started_node_has_frozen_its_start_up_heap_and_exports_process_and_gc_series(tmp_path, monkeypatch) -> None:
    """Started by ``python -m`` (not forked from the harness's server, whose imports are frozen already): what start-up
    built is frozen once the node is built, the collector is on again, and /metrics has the client's standard series."""
    monkeypatch.setenv(FORK_VARIABLE, "0")
    with LocalNode(tmp_path / "n", model="none", extra_args=METRICS) as node:
        samples = scrape(node)
        frozen = samples[("fabric_heap_frozen_objects", frozenset())]
        assert frozen > 20_000, frozen  # a store-only node's imports alone are ~10^5 objects
        assert samples[("process_resident_memory_bytes", frozenset())] > 0
        assert samples[("process_open_fds", frozenset())] > 0
        collections = {labels: value for (name, labels), value in samples.items() if name == "python_gc_collections_total"}
        assert len(collections) == 3, collections  # one per generation
        with node.client() as client:  # the collector runs in a serving node: young objects keep being collected
            for _ in range(300):
                client.store_status()
        after = scrape(node)
        assert after[("python_gc_collections_total", frozenset({("generation", "0")}))] > collections[frozenset({("generation", "0")})]


# ---------------------------------------------------------------- logs


@pytest.mark.slow
def test_json_logs_have_one_line_per_rpc_and_pull_and_never_the_token(tmp_path, adapters) -> None:
    token = "s3cret-token-value-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token)
    with LocalNode(tmp_path / "a", token_file=token_file, extra_args=[*SMALL_CHUNK, "--log-format", "json"]) as a:
        with LocalNode(tmp_path / "b", model="none", token_file=token_file, peers=[a.address], extra_args=[*SMALL_CHUNK, "--log-format", "json"]) as b:
            with a.client() as client:
                client.stage(adapters["alpha"], "alpha")
            with b.client() as client:
                client.promote("alpha", peer=a.address, stage_only=True)
            with NodeClient(a.address, token="wrong-" + token) as intruder, pytest.raises(Unauthenticated):
                intruder.list()
            with NodeClient(a.address) as anonymous, pytest.raises(Unauthenticated):
                anonymous.unstage("alpha")
    entries_a = [json.loads(line) for line in a.log_path.read_text().splitlines() if line.startswith("{")]
    entries_b = [json.loads(line) for line in b.log_path.read_text().splitlines() if line.startswith("{")]
    assert token not in a.log_path.read_text() and token not in b.log_path.read_text()
    stage = [e for e in entries_a if e.get("method") == "Stage"]
    assert len(stage) == 1 and stage[0]["adapter"] == "alpha" and stage[0]["outcome"] == "ok"
    assert stage[0]["bytes"] == (adapters["alpha"] / "adapter_model.safetensors").stat().st_size
    assert {"peer", "duration_s", "time", "level"} <= set(stage[0])
    refused = [e for e in entries_a if e.get("code") == "UNAUTHENTICATED"]
    assert {e["method"] for e in refused} == {"ListAdapters", "Unstage"}
    assert all(e["error"] == "Unauthenticated" and e["level"] == "WARNING" for e in refused)
    pulls = [e for e in entries_b if e.get("logger") == "fabric.pull"]
    assert len(pulls) == 1 and pulls[0]["adapter"] == "alpha" and pulls[0]["peer"] == a.address and pulls[0]["bytes"] > 0
    promote = [e for e in entries_b if e.get("method") == "Promote"]
    assert len(promote) == 1 and promote[0]["outcome"] == "ok" and promote[0]["source_peer"] == a.address


# ---------------------------------------------------------------- drain


#: a receive window far below "big" (~128 KiB): a reader that stops reading holds the node's stream open
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 16 << 10), ("grpc.http2.bdp_probe", 0)]


def _held_fetch(node: LocalNode, digest: str, size: int, first: threading.Event, go: threading.Event, result: dict) -> None:
    """Read one message, then nothing until ``go``: the node's Fetch handler waits on flow control meanwhile."""
    with grpc.insecure_channel(node.address, options=SMALL_WINDOW) as channel:
        fetch = wire.fetch_stub(channel)
        received = 0
        try:
            for _, data in fetch(fabric_pb2.FetchRequest(digest=digest, offset=0, length=size), timeout=WAIT_S):
                received += len(data)
                if not first.is_set():
                    first.set()
                    go.wait(WAIT_S)
        except grpc.RpcError as exc:
            result["error"] = exc.code()
        finally:
            result["received"] = received
            first.set()


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["cut", "finish"])
def test_sigterm_drains_readiness_first_then_fetch_streams_finish_or_are_cut(tmp_path, adapters, bound) -> None:
    """The Fetch is held open by its reader (no rate limit): it outlasts a 2 s bound, or is let go well within 120 s."""
    size = (adapters["big"] / "adapter_model.safetensors").stat().st_size
    drain = "2" if bound == "cut" else "120"
    node = LocalNode(tmp_path / "seed", model="none", extra_args=[*SMALL_CHUNK, *METRICS, "--drain-timeout", drain])
    with node:
        with node.client() as client:
            digest = client.stage(adapters["big"], "big").digest
        first, go, result = threading.Event(), threading.Event(), {}
        reader = threading.Thread(target=_held_fetch, args=(node, digest, size, first, go, result))
        reader.start()
        try:
            assert first.wait(WAIT_S)
            node.process.send_signal(signal.SIGTERM)
            readiness = wait_for(lambda: (lambda s: s if s[0] == 503 else None)(http_get(node.metrics_address, "/readyz")), "/readyz to turn 503")
            assert readiness == (503, "not ready\n")
            if bound == "cut":
                assert node.process.wait(WAIT_S) == 0  # the drain bound passed with the stream still open: cut
            else:  # still listening while the stream runs: a new call is refused by name, not with "connection refused"
                with node.client() as late, pytest.raises(PeerUnavailable, match="is shutting down .*--drain-timeout 120s"):
                    late.list()
        finally:
            go.set()
        reader.join(WAIT_S)
        assert node.process.wait(WAIT_S) == 0
    if bound == "cut":
        assert result["received"] < size and result.get("error") is not None
    else:
        assert result["received"] == size and "error" not in result


def test_an_idle_node_stops_at_once_whatever_its_drain_bound(tmp_path) -> None:
    """No stream to wait for: SIGTERM ends the node well before a 300 s --drain-timeout."""
    node = LocalNode(tmp_path / "idle", model="none", extra_args=["--drain-timeout", "300"])
    with node:
        node.process.send_signal(signal.SIGTERM)
        assert node.process.wait(WAIT_S) == 0


# ---------------------------------------------------------------- peers


@pytest.mark.slow
def test_a_node_on_0000_never_lists_itself_whatever_name_reaches_it(tmp_path, adapters) -> None:
    with LocalNode(tmp_path / "other", model="none") as other:
        port = free_port()  # after the other node listens: taken before, the OS could hand the other node the same free port
        me = LocalNode(
            tmp_path / "me", model="none", host="0.0.0.0",
            port=port, peers=[f"127.0.0.1:{port}", f"localhost:{port}", other.address], extra_args=["--peers-dns", f"localhost:{port}"],
        )  # fmt: skip
        with me:
            with NodeClient(f"127.0.0.1:{port}") as mine, other.client() as theirs:
                mine.stage(adapters["alpha"], "alpha")
                theirs.stage(adapters["alpha"], "alpha")
                holders = [p.address for p in mine.locate("alpha").peers]
    assert holders == [other.address]


def test_is_self_compares_resolved_addresses_and_the_port() -> None:
    from adapter_fabric.transport.discovery import is_self

    assert is_self("127.0.0.1:5000", "0.0.0.0:5000") and is_self("localhost:5000", "0.0.0.0:5000")
    assert is_self("localhost:5000", "127.0.0.1:5000")
    assert not is_self("127.0.0.1:5001", "0.0.0.0:5000")
    assert not is_self("192.0.2.7:5000", "0.0.0.0:5000")  # not an address of this machine
    assert not is_self("127.0.0.2:5000", "127.0.0.1:5000")  # another loopback address, another listener


# ---------------------------------------------------------------- store hygiene


@pytest.mark.slow
def test_an_abandoned_upload_expires_and_its_bytes_leave_the_quota(tmp_path, adapters) -> None:
    weights = adapters["big"] / "adapter_model.safetensors"
    data = weights.read_bytes()
    extra = [*METRICS, "--max-store-bytes", str(10 << 20), "--expire-abandoned-after", "3s"]
    with LocalNode(tmp_path / "n", model="none", extra_args=extra) as node, node.client() as client:
        begin = stage_begin(adapters["big"], "left/behind")
        half = fabric_pb2.StageData(offset=0, data=data[: len(data) // 2])
        with pytest.raises(grpc.RpcError):  # the stream ends before the last byte: the prefix is kept to resume
            fabric_pb2_grpc.FabricStub(client.channel).Stage(iter([fabric_pb2.StageRequest(begin=begin), fabric_pb2.StageRequest(data=half)]), timeout=60)
        held = client.store_status()
        assert [u.adapter_id for u in held.uploads] == ["left/behind"] and held.uploads[0].bytes >= len(data) // 2
        assert held.quota_bytes == 10 << 20 and held.expire_after_seconds == 3 and list(held.damaged) == []
        cli = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "store-status", node.address, "--json"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["uploads"][0]["adapter_id"] in ("left/behind", "")  # expiry may race the CLI
        after = wait_for(lambda: (lambda s: s if not s.uploads else None)(client.store_status()), "the upload to expire")
        assert after.used_bytes <= held.used_bytes - held.uploads[0].bytes
        # counted once the hygiene pass that removed it returns: a scrape right after StoreStatus can come first
        samples = wait_for(lambda: (lambda s: s if value(s, "fabric_store_expired_total", kind="upload") else None)(scrape(node)), "the expiry counted")
        assert value(samples, "fabric_store_expired_total", kind="upload") == 1
        assert value(samples, "fabric_store_expired_bytes_total") == held.uploads[0].bytes
        assert value(samples, "fabric_store_used_bytes") == after.used_bytes


def test_expiry_spares_what_is_in_use_and_recent_and_takes_partials(tmp_path, adapters) -> None:
    from adapter_fabric.store import AdapterStore

    source = AdapterStore(tmp_path / "source", chunk_size=4096)
    manifest = source.stage(adapters["big"], "big")
    store = AdapterStore(tmp_path / "store", chunk_size=4096)
    partial = store.open_partial(manifest)
    blob = source.blob_path(manifest.weights.root).read_bytes()
    partial.write_chunk(0, blob[:4096])
    later = time.time() + 3600
    assert [item.kind for item in store.leftovers()] == ["partial"]
    assert store.expire_abandoned(60, now=later) == []  # a pull holds it
    partial.close()
    assert store.expire_abandoned(7200, now=later) == []  # not old enough
    used = store.usage()
    removed = store.expire_abandoned(60, now=later)
    assert [(r.kind, r.digest, r.adapter_id) for r in removed] == [("partial", manifest.digest, "big")]
    assert store.usage() == used - removed[0].bytes and store.leftovers() == []


# ---------------------------------------------------------------- errors for other languages


@pytest.mark.slow
def test_errors_carry_grpc_status_details_with_the_error_type(tmp_path) -> None:
    with LocalNode(tmp_path / "n", model="none") as node, grpc.insecure_channel(node.address) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.GetManifest(manifest_request("nobody"), timeout=30)
        status = rpc_status.from_call(failed.value)
        assert status is not None and status.code == grpc.StatusCode.NOT_FOUND.value[0]
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info)
        assert (info.reason, info.domain) == ("AdapterNotFound", "fabric.v1")
        with NodeClient(node.address) as client, pytest.raises(AdapterNotFound):  # the fabric trailer still works
            client.manifest("nobody")
    with pytest.raises(PeerUnavailable):
        NodeClient(node.address, timeout=5).list()


@pytest.mark.slow
def test_peers_dialled_by_ip_are_verified_against_the_peer_tls_name(tmp_path, adapters) -> None:
    """As in a StatefulSet: one certificate naming the headless Service, peers dialled by an IP it does not name.

    The nodes listen on 0.0.0.0 (the harness and the operator reach them there, an address the certificate
    names); peers dial the seed at 127.0.0.2, which it does not name, as pods dial pod IPs."""
    ca = TestCA(tmp_path / "ca")
    shared = ca.issue("fabric-peers", hosts=("fabric-peers", "0.0.0.0"))
    tls = TlsFiles(shared.cert, shared.key, shared.ca)
    with LocalNode(tmp_path / "a", model="none", host="0.0.0.0", tls=tls, extra_args=SMALL_CHUNK) as a:
        with a.client() as seed:
            seed.stage(adapters["alpha"], "alpha")
        by_ip = "127.0.0.2:" + a.address.rsplit(":", 1)[1]
        named = LocalNode(tmp_path / "b", model="none", host="0.0.0.0", tls=tls, extra_args=[*SMALL_CHUNK, "--peer-tls-name", "fabric-peers"])
        # with --peer-tls-name a peer's certificate proves it a member (transport.membership); without it, only --peers are members
        unnamed = LocalNode(tmp_path / "c", model="none", host="0.0.0.0", tls=tls, peers=[by_ip], extra_args=SMALL_CHUNK)
        with named as b, unnamed as c:
            with b.client() as client:
                assert client.promote("alpha", peer=by_ip, stage_only=True).bytes_transferred > 0
            with c.client() as client, pytest.raises(PeerUnavailable):  # without the flag, 127.0.0.2 is not in the certificate
                client.promote("alpha", peer=by_ip, stage_only=True)


@pytest.mark.slow
def test_readyz_is_false_until_store_recovery_finishes(tmp_path) -> None:
    """Recovery waits on the store's lock; while the test holds it, the node is live but not ready."""
    import fcntl
    import os

    store = tmp_path / "store"
    store.mkdir()
    fd = os.open(store / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    port = free_port()
    node = LocalNode(store, model="none", extra_args=["--metrics-listen", f"127.0.0.1:{port}"])
    node.launch()
    try:
        wait_for(lambda: _answers(f"127.0.0.1:{port}"), "/healthz to answer")
        assert http_get(f"127.0.0.1:{port}", "/readyz") == (503, "not ready\n")
        os.close(fd)  # recovery runs, the node comes up
        node.wait_ready()
        assert http_get(f"127.0.0.1:{port}", "/readyz") == (200, "ready\n")
    finally:
        node.stop()


def _answers(address: str) -> bool:
    try:
        return http_get(address, "/healthz")[0] == 200
    except OSError:
        return False


@pytest.mark.slow
def test_a_bad_model_directory_is_one_line(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    done = subprocess.run(
        [sys.executable, "-m", "adapter_fabric.node.main", "--model", str(tmp_path / "model"), "--store", str(tmp_path / "s"), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1 and "--model" in lines[0] and "cannot load it" in lines[0], done.stderr
