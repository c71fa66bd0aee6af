"""Security and limits, against real node processes: mTLS, the bearer token, and the size and stream limits.

Two small clusters, each started once for the module:
- secure: n1 (tiny model) and n2 (store-only seeder, --auth-peer-reads), both
  mutual TLS with certificates from a CA made here, both with one token;
- limits: a plain seeder S with a store quota, and L (tiny model) with small
  adapter, header and stream limits.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from adapter_fabric.rpc import security

from adapter_fabric.transport import wire
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.errors import InvalidHeader, LimitExceeded, PeerUnavailable, QuotaExceeded, Unauthenticated
from adapter_fabric.format.safetensors_index import read_index
from adapter_fabric.rpc.security import TlsFiles
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.certs import TestCA
from tests.support.store import stage_begin

TOKEN = "a6f1c0ffee-cluster-token"
SMALL_CHUNK = ["--chunk-size", "4096"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [3, 14, 15, 92]


def weights(adapter_dir: Path) -> Path:
    return adapter_dir / "adapter_model.safetensors"


def adapter_bytes(adapter_dir: Path) -> int:
    """What a store holds for it: config and weights (save_pretrained also writes a README that is not staged)."""
    return (adapter_dir / "adapter_config.json").stat().st_size + weights(adapter_dir).stat().st_size


def state(client: NodeClient) -> fabric_pb2.ListAdaptersResponse:
    return client.list()


def store_area_empty(node: LocalNode, area: str) -> bool:
    return not any((node.store / area).iterdir())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    specs = {
        "small": dict(r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "small2": dict(r=4, target_modules=["q_proj", "v_proj"], seed=2),
        "medium": dict(r=8, target_modules=["q_proj", "v_proj", "o_proj"], seed=3),  # ~6 chunks of 4 KiB
        "heavy": dict(r=16, target_modules=["q_proj", "v_proj", "o_proj"], seed=4),  # over L's adapter limit
        "wide": dict(r=1, target_modules=ALL, seed=5),  # many tensors: over L's header limit, under its size limit
    }
    return {name: make_peft_adapter(root / name, base_model=base, **spec) for name, spec in specs.items()}


# ---------------------------------------------------------------- the secure cluster


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TlsFiles]:
    root = tmp_path_factory.mktemp("pki")
    ca = TestCA(root / "ca")
    rogue = TestCA(root / "rogue", name="rogue-ca")
    rogue_leaf = rogue.issue("intruder")
    return {
        "n1": ca.issue("node1"),
        "n2": ca.issue("node2"),
        "client": ca.issue("operator"),
        # trusts the right CA (so it can verify the node) but presents a certificate the node's CA never signed
        "rogue": TlsFiles(cert=rogue_leaf.cert, key=rogue_leaf.key, ca=ca.cert_path),
        # TLS with the right CA but no client certificate at all
        "no-cert": TlsFiles(ca=ca.cert_path),
    }


@pytest.fixture(scope="module")
def secure(tmp_path_factory, pki) -> dict[str, LocalNode]:
    root = tmp_path_factory.mktemp("secure")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    n2_port = free_port()
    nodes = {
        # n2 is n1's member (--peers): n1 presents its certificate and token to members only (transport.membership)
        "n1": LocalNode(root / "n1", tls=pki["n1"], token_file=token_file, peers=[f"127.0.0.1:{n2_port}"], extra_args=SMALL_CHUNK),
        "n2": LocalNode(root / "n2", model="none", port=n2_port, tls=pki["n2"], token_file=token_file, extra_args=[*SMALL_CHUNK, "--auth-peer-reads"]),
    }
    try:
        for node in nodes.values():
            node.launch()
        for node in nodes.values():
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


def client_of(node: LocalNode, tls: TlsFiles | None, token: str | None) -> NodeClient:
    return NodeClient(node.address, tls=tls, token=token, timeout=20)


@pytest.mark.slow
def test_stage_and_promote_across_nodes_over_mtls(secure, pki, adapters) -> None:
    n1, n2 = secure["n1"], secure["n2"]
    with client_of(n2, pki["client"], TOKEN) as c2, client_of(n1, pki["client"], TOKEN) as c1:
        staged = c2.stage(adapters["small"], "sec/small")
        # n1 pulls from n2, which requires mTLS and the token even for peer reads: n1 presents its own cert and token.
        promoted = c1.promote("sec/small", peer=n2.address, name="small")
        assert promoted.digest == staged.digest
        assert promoted.bytes_transferred == weights(adapters["small"]).stat().st_size
        assert promoted.source_peer == n2.address
        assert c1.generate(PROMPT, "small").content_id == staged.content_id


@pytest.mark.slow
@pytest.mark.parametrize("who", ["plaintext", "rogue", "no-cert"])
def test_clients_without_a_trusted_certificate_fail_and_change_nothing(secure, pki, adapters, who) -> None:
    n1 = secure["n1"]
    with client_of(n1, pki["client"], TOKEN) as good:
        before = state(good)
        with client_of(n1, None if who == "plaintext" else pki[who], TOKEN) as bad:
            for call in (lambda: bad.stage(adapters["small2"], "sec/intruder"), lambda: bad.unstage("sec/small")):
                with pytest.raises(PeerUnavailable, match="UNAVAILABLE"):
                    call()
        assert state(good) == before


@pytest.fixture(scope="module")
def resident(secure, pki, adapters) -> str:
    """n1 holds 'sec/resident' staged and promoted: something Unstage, SetActive and Pin could change."""
    with client_of(secure["n1"], pki["client"], TOKEN) as c1:
        c1.stage(adapters["small"], "sec/resident")
        c1.promote("sec/resident", name="resident")
    return "resident"


MUTATIONS = {
    "Stage": lambda c, a: c.stage(a["small2"], "sec/stage-attempt"),
    "Promote": lambda c, a: c.promote("sec/resident", name="resident-again"),
    "Unstage": lambda c, a: c.unstage("sec/resident"),
    "SetActive": lambda c, a: c.set_active("resident"),
    "Pin": lambda c, a: c.pin("resident", True),
    "UploadOffset": lambda c, a: c._call(c.stub.UploadOffset, fabric_pb2.UploadOffsetRequest(adapter_id="sec/x", safetensors_blake3="0" * 64)),
    "Generate": lambda c, a: c.generate(PROMPT, "resident"),
    "ListAdapters": lambda c, a: c.list(),
}


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
@pytest.mark.parametrize("rpc", list(MUTATIONS))
def test_calls_without_the_token_are_unauthenticated_and_change_nothing(secure, pki, adapters, resident, rpc, token) -> None:
    n1 = secure["n1"]
    with client_of(n1, pki["client"], TOKEN) as good, client_of(n1, pki["client"], token) as bad:
        before = state(good)
        with pytest.raises(Unauthenticated, match="bearer token"):
            MUTATIONS[rpc](bad, adapters)
        assert state(good) == before
        assert store_area_empty(n1, "uploads")


@pytest.mark.slow
def test_the_status_code_is_unauthenticated(secure, pki) -> None:
    """The code itself, as any gRPC client in any language sees it."""
    creds = pki["client"].channel_credentials()
    with security.channel(secure["n1"].address, credentials=creds) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            fabric_pb2_grpc.FabricStub(channel).Unstage(fabric_pb2.UnstageRequest(adapter_id="sec/resident"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--auth-token-file" in caught.value.details()


def _fetch_first_chunk(node: LocalNode, tls: TlsFiles, token: str | None, digest: str) -> tuple[int, bytes]:
    with security.channel(node.address, credentials=tls.channel_credentials(), token=token) as channel:
        call = wire.fetch_stub(channel)(fabric_pb2.FetchRequest(digest=digest), timeout=20)
        try:
            offset, data = next(call)
            return offset, bytes(data)
        finally:
            call.cancel()


@pytest.mark.slow
def test_peer_reads_are_open_unless_the_flag_limits_them(secure, pki, adapters) -> None:
    n1, n2 = secure["n1"], secure["n2"]
    with client_of(n1, pki["client"], TOKEN) as c1, client_of(n2, pki["client"], TOKEN) as c2:
        digest = c1.stage(adapters["small"], "sec/reads").digest
        c2.stage(adapters["small"], "sec/reads")
    first = weights(adapters["small"]).read_bytes()[:4096]

    # n1: peer reads open. A peer with a trusted certificate but no token may read.
    with client_of(n1, pki["client"], None) as anonymous:
        assert anonymous.manifest("sec/reads").digest == digest
    assert _fetch_first_chunk(n1, pki["client"], None, digest) == (0, first)

    # n2 (--auth-peer-reads): the same calls need the token.
    with client_of(n2, pki["client"], None) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.manifest("sec/reads")
        with pytest.raises(Unauthenticated):
            anonymous._call(anonymous.stub.Availability, fabric_pb2.AvailabilityRequest(digest=digest))
    with pytest.raises(grpc.RpcError) as caught:
        _fetch_first_chunk(n2, pki["client"], "wrong-token", digest)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _fetch_first_chunk(n2, pki["client"], TOKEN, digest) == (0, first)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n1", "n2"])
def test_health_and_reflection_stay_open(secure, pki, name) -> None:
    creds = pki["client"].channel_credentials()  # the transport still needs mTLS; no token
    with security.channel(secure[name].address, credentials=creds) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="fabric.v1.Fabric"), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "fabric.v1.Fabric" in services


BAD_FLAGS = [
    (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "cannot read the TLS key"),
    (["--tls-ca", "CA"], "needs --tls-cert and --tls-key"),
    (["--auth-token-file", "EMPTY"], "is empty"),
]


def _flags(tmp_path: Path, pki, flags: list[str]) -> list[str]:
    (tmp_path / "EMPTY").write_text("\n")
    return [str(pki["client"].ca) if f == "CA" else str(tmp_path / f) if f == "EMPTY" else f for f in flags]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_bad_security_flags_are_refused_with_a_clear_message(tmp_path, pki, flags, message) -> None:
    from adapter_fabric.node.startup import load_security
    from adapter_fabric.node.settings import parse_settings

    with pytest.raises(SystemExit, match=message):
        load_security(parse_settings(["--store", str(tmp_path / "store"), *_flags(tmp_path, pki, flags)]))


@pytest.mark.slow
def test_a_bad_security_flag_stops_the_node_process_at_start(tmp_path, pki) -> None:
    flags, message = BAD_FLAGS[-1]
    done = subprocess.run(
        [sys.executable, "-m", "adapter_fabric.node.main", "--model", "none", "--store", str(tmp_path / "store"), "--listen", "127.0.0.1:0", *_flags(tmp_path, pki, flags)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert message in done.stderr
    assert "listening" not in done.stdout


# ---------------------------------------------------------------- limits


@pytest.fixture(scope="module")
def limits(tmp_path_factory, adapters) -> dict[str, object]:
    sizes = {name: adapter_bytes(path) for name, path in adapters.items()}
    headers = {name: read_index(weights(path)).header_size for name, path in adapters.items()}
    max_adapter = (sizes["medium"] + sizes["heavy"]) // 2
    max_header = (headers["heavy"] + headers["wide"]) // 2
    assert max(sizes["small"], sizes["medium"], sizes["wide"]) < max_adapter < sizes["heavy"]
    assert max(headers["small"], headers["heavy"]) < max_header < headers["wide"]
    # S holds heavy and wide; small does not fit beside them.
    store_quota = sizes["heavy"] + sizes["wide"] + sizes["small"] // 2

    root = tmp_path_factory.mktemp("limits")
    seeder = LocalNode(root / "S", model="none", extra_args=[*SMALL_CHUNK, "--max-store-bytes", str(store_quota), "--when-full", "refuse"])
    limited = LocalNode(
        root / "L",
        extra_args=[
            *SMALL_CHUNK,
            "--max-adapter-bytes", str(max_adapter),
            "--max-header-bytes", str(max_header),
            "--max-streams-per-peer", "2",
            "--upload-rate", "1",  # about one chunk a second: a Fetch stream of 'medium' stays open for seconds
        ],
    )  # fmt: skip
    nodes = {"S": seeder, "L": limited}
    try:
        for node in nodes.values():
            node.launch()
        for node in nodes.values():
            node.wait_ready()
        with seeder.client() as s:
            s.stage(adapters["heavy"], "lim/heavy")
            s.stage(adapters["wide"], "lim/wide")
        yield {**nodes, "max_adapter": max_adapter, "max_header": max_header}
    finally:
        for node in nodes.values():
            node.stop()


@pytest.mark.slow
def test_stage_over_the_adapter_limit_is_refused_before_writing(limits, adapters) -> None:
    node: LocalNode = limits["L"]
    with node.client() as c:
        before = state(c)
        with pytest.raises(LimitExceeded, match=f"limit of {limits['max_adapter']}.*--max-adapter-bytes"):
            c.stage(adapters["heavy"], "lim/heavy")
        assert state(c) == before
    assert store_area_empty(node, "uploads")


@pytest.mark.slow
def test_stage_with_a_header_over_the_limit_is_refused_before_writing(limits, adapters) -> None:
    node: LocalNode = limits["L"]
    with node.client() as c:
        before = state(c)
        with pytest.raises(InvalidHeader, match=f"limit of {limits['max_header']}"):
            c.stage(adapters["wide"], "lim/wide")
        assert state(c) == before
    assert store_area_empty(node, "uploads")


@pytest.mark.slow
@pytest.mark.parametrize(("adapter_id", "error", "flag"), [("lim/heavy", LimitExceeded, "--max-adapter-bytes"), ("lim/wide", InvalidHeader, "--max-header-bytes")])
def test_a_peer_manifest_over_a_limit_is_refused_before_any_byte_moves(limits, adapter_id, error, flag) -> None:
    node, seeder = limits["L"], limits["S"]
    with node.client() as c:
        before = state(c)
        with pytest.raises(error, match=flag):
            c.promote(adapter_id, peer=seeder.address)
        assert state(c) == before
    assert store_area_empty(node, "partial")


@pytest.mark.slow
def test_the_store_quota_refuses_a_stage_before_writing(limits, adapters) -> None:
    node: LocalNode = limits["S"]
    with node.client() as c:
        before = state(c)
        assert {"lim/heavy", "lim/wide"} <= {a.adapter_id for a in before.staged}
        with pytest.raises(QuotaExceeded, match="limit"):
            c.stage(adapters["small"], "lim/small")
        assert state(c) == before
    assert store_area_empty(node, "uploads")
    # The raw code is RESOURCE_EXHAUSTED, as every gRPC client sees it.
    with grpc.insecure_channel(node.address) as channel:
        stub = fabric_pb2_grpc.FabricStub(channel)
        begin = stage_begin(adapters["small"], "lim/raw", 4096, weights_root="ab" * 32)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Stage(iter([fabric_pb2.StageRequest(begin=begin)]), timeout=20)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.slow
def test_fetch_streams_per_peer_are_limited(limits, adapters) -> None:
    node: LocalNode = limits["L"]
    with node.client() as c:
        digest = c.stage(adapters["medium"], "lim/medium").digest
    request = fabric_pb2.FetchRequest(digest=digest)
    with grpc.insecure_channel(node.address, options=wire.CHANNEL_OPTIONS) as channel:
        fetch = wire.fetch_stub(channel)
        held = [fetch(request, timeout=60) for _ in range(2)]
        try:
            for call in held:
                assert next(call)[0] == 0  # each stream is open and serving
            extra = fetch(request, timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                next(extra)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams-per-peer" in caught.value.details()

            # Ending one stream frees its place (the node notices the cancel asynchronously: retry until it has).
            held.pop(0).cancel()
            deadline = time.monotonic() + 30
            while True:
                again = fetch(request, timeout=60)
                try:
                    assert next(again)[0] == 0
                    held.append(again)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "a cancelled stream never gave its place back"
                    time.sleep(0.05)
        finally:
            for call in held:
                call.cancel()


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:10.0.0.2:5123", "10.0.0.2"), ("ipv6:[::1]:40000", "[::1]"), ("unix:/tmp/sock", "/tmp/sock"), ("weird", "weird")],
)
def test_streams_are_counted_per_peer_host(peer, host) -> None:
    from adapter_fabric.rpc.limits import peer_host

    assert peer_host(peer) == host


def test_which_methods_need_the_token() -> None:
    from adapter_fabric.rpc.security import BearerAuth

    for peer_reads in (False, True):
        auth = BearerAuth(TOKEN, peer_reads=peer_reads)
        assert not auth.requires_token("/grpc.health.v1.Health/Check")
        assert not auth.requires_token("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        for method in ("Stage", "UploadOffset", "Promote", "Unstage", "SetActive", "Pin", "Generate", "ListAdapters", "SomethingNew"):
            assert auth.requires_token(f"/fabric.v1.Fabric/{method}")
        for method in ("Fetch", "GetManifest", "Availability", "Locate"):
            assert auth.requires_token(f"/fabric.v1.Fabric/{method}") is peer_reads
        assert auth.authorized((("authorization", f"Bearer {TOKEN}"),))
        assert not auth.authorized((("authorization", f"bearer {TOKEN}"),))
        assert not auth.authorized((("authorization", f"Bearer {TOKEN[:-1]}"),))
        assert not auth.authorized((("x-token", TOKEN),))
        assert not auth.authorized(None)


@pytest.mark.parametrize(("content", "message"), [(b"", "is empty"), (b"two words", "without spaces"), ("t\u00f6ken".encode(), "non-ASCII")])
def test_bad_token_files_are_refused(tmp_path, content, message) -> None:
    from adapter_fabric.errors import InvalidArgument
    from adapter_fabric.rpc.security import read_token

    (tmp_path / "token").write_bytes(content)
    with pytest.raises(InvalidArgument, match=message):
        read_token(tmp_path / "token")
    (tmp_path / "token").write_bytes(b"  good-token\n")
    assert read_token(tmp_path / "token") == "good-token"
