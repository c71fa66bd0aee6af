"""Hostile and broken input: every case is refused with a clear error and changes nothing.

The corpus (tests/hostile/corpus.py) breaks one thing at a time in a real PEFT
adapter. Each case runs through the library (``AdapterStore.stage``,
``MultiLoraModel.prepare``) and through a real node over gRPC (the Stage RPC
with raw stubs, Promote, and peers that lie), and checks the state before and
after: every file under the store root, ``ListAdapters`` and the slots.
One seeder and one model node serve the whole module.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from tests.support import PEERS
from tests.support.store import blake3_of, snapshot, stage_begin
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.errors import (
    Busy,
    FieldTooLarge,
    FabricError,
    IncompatibleFormat,
    IntegrityError,
    InvalidAdapter,
    InvalidAdapterId,
    InvalidArgument,
    InvalidConfig,
    InvalidHeader,
)
from adapter_fabric.store.manifest import Manifest, manifest_request
from adapter_fabric.serving.multi_lora import MultiLoraModel
from adapter_fabric.rpc.status import error_from_rpc, status_code_for
from adapter_fabric.store import AdapterStore
from adapter_fabric.serving.tiny import build_tiny_model
from adapter_fabric.transport.pull import PeerPuller
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.hostile_corpus import ALL_ADAPTER_CASES, BAD_IDS, CASES_BY_NAME, WEIGHTS, AdapterCase, build_adapters

pytestmark = pytest.mark.timeout(180)

STAGE_CASES = [c.name for c in ALL_ADAPTER_CASES if c.refused_at == "stage"]
PROMOTE_CASES = [c.name for c in ALL_ADAPTER_CASES if c.refused_at == "promote"]
CLIENT_SIDE = {"config_missing", "weights_missing"}  # no file to send: the client refuses before any RPC
PIECE = 4096


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base():
    return build_tiny_model()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, base) -> dict[str, Path]:
    return build_adapters(tmp_path_factory.mktemp("corpus"), base)


@pytest.fixture(scope="module")
def model(base) -> MultiLoraModel:
    return MultiLoraModel(base, slots=2, max_rank=16, device="cpu")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, corpus) -> Iterator[tuple[LocalNode, LocalNode]]:
    root = tmp_path_factory.mktemp("nodes")
    seeder = LocalNode(root / "seeder", model="none")
    node = LocalNode(root / "node", slots=2, max_rank=16)
    for each in (seeder, node):
        each.launch()
    try:
        for each in (seeder, node):
            each.wait_ready()
        for each in (seeder, node):  # one committed adapter, so "nothing changed" is not about an empty store
            with grpc.insecure_channel(each.address) as channel:
                stage_raw(fabric_pb2_grpc.FabricStub(channel), corpus["good"], "good")
        yield seeder, node
    finally:
        seeder.stop()
        node.stop()


@pytest.fixture(scope="module")
def stub(nodes) -> Iterator[fabric_pb2_grpc.FabricStub]:
    with grpc.insecure_channel(nodes[1].address) as channel:
        yield fabric_pb2_grpc.FabricStub(channel)


@pytest.fixture
def store(tmp_path, corpus) -> AdapterStore:
    store = AdapterStore(tmp_path / "store", chunk_size=PIECE)
    store.stage(corpus["good"], "good")
    return store


# ---------------------------------------------------------------- helpers


def begin_for(adapter_dir: Path, adapter_id: str, **overrides) -> fabric_pb2.StageRequest:
    return fabric_pb2.StageRequest(begin=stage_begin(adapter_dir, adapter_id, **overrides))  # the nodes stage at the default chunk size


def data_messages(data: bytes, start: int = 0) -> list[fabric_pb2.StageRequest]:
    return [
        fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=start + i, data=data[i : i + PIECE])) for i in range(0, len(data), PIECE)
    ]


def stage_raw(stub, adapter_dir: Path, adapter_id: str) -> fabric_pb2.StageResponse:
    """The Stage RPC with the generated stub: one StageBegin, then the file in 4 KiB pieces."""
    messages = [begin_for(adapter_dir, adapter_id), *data_messages((adapter_dir / WEIGHTS).read_bytes())]
    return stub.Stage(iter(messages), timeout=30)


def node_state(stub, node: LocalNode, *, committed_only: bool = False) -> tuple:
    """ListAdapters (staged ids and digests, slots) and every file under the node's store root."""
    reply = stub.ListAdapters(fabric_pb2.ListAdaptersRequest(), timeout=30)
    files = snapshot(node.store)
    if committed_only:  # uploads keep an interrupted stream's bytes for a resume
        files = {path: digest for path, digest in files.items() if not path.startswith("uploads")}
    return (
        sorted((s.adapter_id, s.digest) for s in reply.staged),
        sorted((s.slot, s.name, s.content_id, s.active) for s in reply.slots),
        files,
    )


def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, FabricError]:
    """Run a gRPC call that must fail; its status code and the library error it stands for."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), error_from_rpc(info.value)


def check_error(error: BaseException, case: AdapterCase) -> None:
    assert isinstance(error, case.error), f"{case.name}: {type(error).__name__}: {error}"
    assert re.search(case.match, str(error)), f"{case.name}: message {str(error)!r} does not match {case.match!r}"


def pool_state(model: MultiLoraModel) -> list:
    return [(s.slot, s.name, s.content_id, s.active) for s in model.slots_info()]


# ---------------------------------------------------------------- the corpus itself


def test_corpus_holds_at_least_thirty_malformed_inputs() -> None:
    total = len(ALL_ADAPTER_CASES) + len(BAD_IDS) + len(MANIFEST_LIES) + len(LIAR_MODES) + len(STREAM_CASES) + 1
    assert total >= 30, total
    assert len(set(CASES_BY_NAME)) == len(ALL_ADAPTER_CASES)


@pytest.mark.slow
def test_the_good_adapter_is_accepted_everywhere(corpus, store, model, nodes, stub) -> None:
    """The baseline each case departs from: staged, prepared and promoted without complaint."""
    assert store.get("good").weights.size == (corpus["good"] / WEIGHTS).stat().st_size
    model.prepare(corpus["good"], "good")
    assert stub.Promote(fabric_pb2.PromoteRequest(adapter_id="good", name="good"), timeout=60).slot >= 0


# ---------------------------------------------------------------- malformed adapters: library


@pytest.mark.parametrize("name", STAGE_CASES)
def test_store_refuses_malformed_adapter(name, corpus, store) -> None:
    case = CASES_BY_NAME[name]
    before, listed = snapshot(store.root), store.list()
    with pytest.raises(FabricError) as info:
        store.stage(corpus[name], f"hostile/{name}")
    check_error(info.value, case)
    assert snapshot(store.root) == before
    assert store.list() == listed


@pytest.mark.parametrize("name", STAGE_CASES + PROMOTE_CASES)
def test_model_prepare_refuses_and_touches_no_slot(name, corpus, model) -> None:
    case = CASES_BY_NAME[name]
    before = pool_state(model)
    with pytest.raises(FabricError) as info:
        model.prepare(corpus[name], name)
    check_error(info.value, case)
    assert pool_state(model) == before


@pytest.mark.parametrize("name", PROMOTE_CASES)
def test_store_keeps_well_formed_adapters_the_model_refuses(name, corpus, store) -> None:
    """Decision (docs/RELIABILITY.md): the store holds bytes, it does not judge weight values or model fit."""
    manifest = store.stage(corpus[name], f"hostile/{name}")
    assert store.verify(f"hostile/{name}") == manifest


# ---------------------------------------------------------------- malformed adapters: a node over gRPC


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE_CASES)
def test_node_stage_refuses_malformed_adapter(name, corpus, nodes, stub) -> None:
    case = CASES_BY_NAME[name]
    node = nodes[1]
    before = node_state(stub, node)
    if name in CLIENT_SIDE:
        from adapter_fabric.client.node_client import NodeClient

        with NodeClient(node.address) as client, pytest.raises(FabricError) as info:
            client.stage(corpus[name], f"hostile/{name}")
        error = info.value
    else:
        code, error = refused(lambda: stage_raw(stub, corpus[name], f"hostile/{name}"))
        assert code == status_code_for(case.error("")) == grpc.StatusCode.INVALID_ARGUMENT
    check_error(error, case)
    assert node_state(stub, node) == before


@pytest.mark.slow
@pytest.mark.parametrize("name", PROMOTE_CASES)
def test_node_promote_refuses_and_loads_nothing(name, corpus, nodes, stub) -> None:
    case = CASES_BY_NAME[name]
    node = nodes[1]
    adapter_id = f"hostile/{name}"
    stage_raw(stub, corpus[name], adapter_id)  # well-formed bytes: the store takes them (see the decision above)
    staged, slots, files = node_state(stub, node)
    code, error = refused(lambda: stub.Promote(fabric_pb2.PromoteRequest(adapter_id=adapter_id, name=name), timeout=60))
    assert code == status_code_for(case.error(""))
    check_error(error, case)
    after_staged, after_slots, after_files = node_state(stub, node)
    assert (after_staged, after_slots) == (staged, slots)
    # A refused prepare may leave the adapter's materialized view (hard links to its committed blobs).
    assert {p: d for p, d in after_files.items() if not p.startswith("views/")} == {p: d for p, d in files.items() if not p.startswith("views/")}
    stub.Unstage(fabric_pb2.UnstageRequest(adapter_id=adapter_id), timeout=30)


# ---------------------------------------------------------------- ids


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_bad_id_is_refused_by_store_and_node(name, corpus, store, nodes, stub) -> None:
    adapter_id = BAD_IDS[name]
    before = snapshot(store.root)
    with pytest.raises(InvalidAdapterId):
        store.stage(corpus["good"], adapter_id)
    assert snapshot(store.root) == before

    node = nodes[1]
    state = node_state(stub, node)
    calls = {
        "Stage": lambda: stub.Stage(iter([begin_for(corpus["good"], adapter_id), *data_messages((corpus["good"] / WEIGHTS).read_bytes())]), timeout=30),
        "UploadOffset": lambda: stub.UploadOffset(fabric_pb2.UploadOffsetRequest(adapter_id=adapter_id, safetensors_blake3="0" * 64), timeout=30),
        "GetManifest": lambda: stub.GetManifest(manifest_request(adapter_id), timeout=30),
        "Promote": lambda: stub.Promote(fabric_pb2.PromoteRequest(adapter_id=adapter_id), timeout=30),
        "Unstage": lambda: stub.Unstage(fabric_pb2.UnstageRequest(adapter_id=adapter_id), timeout=30),
    }
    for method, call in calls.items():
        code, error = refused(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, method
        # An id past the field bound (adapter_fabric.rpc.bounds) is refused at the service edge as FieldTooLarge, by field name.
        assert isinstance(error, (InvalidAdapterId, FieldTooLarge)), f"{method}: {type(error).__name__}: {error}"
        assert len(str(error)) < 400, "a 10 KB id must not come back as a 10 KB message"
    assert node_state(stub, node) == state


# ---------------------------------------------------------------- manifests that lie


def _weights(pb: fabric_pb2.Manifest) -> fabric_pb2.FileEntry:
    return pb.files[1]


MANIFEST_LIES: dict[str, tuple[Callable[[fabric_pb2.Manifest], None], type[FabricError], str]] = {
    # The size is part of the root's material: a size lie is caught there, before the tensor index is checked.
    "weights_size_minus_one": (lambda pb: setattr(_weights(pb), "size", _weights(pb).size - 1), IntegrityError, r"does not match its chunk digests"),
    "weights_size_doubled": (lambda pb: setattr(_weights(pb), "size", _weights(pb).size * 2), IntegrityError, r"chunk digests"),
    "weights_root_changed": (lambda pb: setattr(_weights(pb), "root", "ab" * 32), IntegrityError, r"does not match its chunk digests"),
    "weights_root_not_hex": (lambda pb: setattr(_weights(pb), "root", "zz" * 32), InvalidAdapter, r"root 'zz.* is not a digest"),
    "config_root_changed": (lambda pb: setattr(pb.files[0], "root", "cd" * 32), IntegrityError, r"does not match its chunk digests"),
    "chunk_digest_changed": (lambda pb: _weights(pb).chunk_digests.__setitem__(0, bytes(32)), IntegrityError, r"does not match its chunk digests"),
    "digest_scheme_unset": (lambda pb: pb.ClearField("digest_scheme"), IncompatibleFormat, r"digest scheme 1 .*this node reads and writes scheme 2"),
    "digest_changed": (lambda pb: setattr(pb, "digest", "ef" * 32), IntegrityError, r"does not match its files"),
    "content_id_changed": (lambda pb: setattr(pb, "content_id", pb.content_id ^ 1), IntegrityError, r"content_id"),
    "chunk_digest_missing": (lambda pb: _weights(pb).chunk_digests.pop(), IntegrityError, r"chunk digests"),
    "chunk_digest_short": (lambda pb: _weights(pb).chunk_digests.__setitem__(0, b"\0" * 31), InvalidAdapter, r"not 32 raw bytes"),
    "chunk_size_zero": (lambda pb: setattr(_weights(pb), "chunk_size", 0), InvalidAdapter, r"chunk"),
    "config_json_changed": (lambda pb: setattr(pb, "config_json", pb.config_json.replace(b'"r": 4', b'"r": 8')), IntegrityError, r"does not match config_json"),
    "peft_fields_lie": (lambda pb: setattr(pb.peft, "r", 8), IntegrityError, r"peft fields disagree"),
    "tensor_shape_lie": (lambda pb: pb.tensors[0].shape.__setitem__(1, 65), InvalidHeader, r"tensor index is invalid"),
    "tensor_dropped": (lambda pb: pb.tensors.pop(), IntegrityError, r"adds up to|lora_B is missing"),
    "header_size_lie": (lambda pb: setattr(pb, "header_size", pb.header_size + 8), IntegrityError, r"adds up to"),
    "files_missing": (lambda pb: pb.files.pop(), InvalidAdapter, r"must be exactly"),
    "adapter_id_traversal": (lambda pb: setattr(pb, "adapter_id", "../../etc"), InvalidAdapterId, r"'\.\.'"),
}


@pytest.mark.parametrize("name", sorted(MANIFEST_LIES))
def test_manifest_from_proto_refuses_a_lie(name, store) -> None:
    mutate, error, match = MANIFEST_LIES[name]
    pb = store.get("good").to_proto()
    Manifest.from_proto(pb)  # the truth parses
    mutate(pb)
    with pytest.raises(error, match=match):
        Manifest.from_proto(pb)


LIAR_MODES = {
    "size": (IntegrityError, r"adds up to|chunk digests"),
    "digest": (IntegrityError, r"does not match its files"),
    "content_id": (IntegrityError, r"content_id"),
    "other_id": (IntegrityError, r"answered for 'good-other' when asked for 'good'"),
    "chunks": (IntegrityError, r"root [0-9a-f]+ does not match its chunk digests"),
}


@pytest.fixture
def liar(request, nodes) -> Iterator[str]:
    relay = subprocess.Popen([sys.executable, str(PEERS / "lying_peer.py"), nodes[0].address, "--mode", request.param], stdout=subprocess.PIPE, text=True)
    try:
        yield relay.stdout.readline().split()[-1]
    finally:
        relay.kill()
        relay.wait()


@pytest.mark.slow
@pytest.mark.parametrize("liar", sorted(LIAR_MODES), indirect=True)
def test_lying_peer_is_refused_by_puller_and_node(liar, request, tmp_path, corpus, nodes, stub) -> None:
    mode = request.node.callspec.params["liar"]
    error, match = LIAR_MODES[mode]
    # The library: a PeerPuller into a fresh store.
    store = AdapterStore(tmp_path / "puller", chunk_size=PIECE)
    before = snapshot(store.root)
    puller = PeerPuller(store)
    try:
        with pytest.raises(error, match=match):
            puller.pull([liar], "good")
    finally:
        puller.channels.close()
    assert snapshot(store.root) == before and store.list() == []
    # A node: Promote from the liar. The node must not hold the bytes already, or nothing would be pulled.
    node = nodes[1]
    stub.Unstage(fabric_pb2.UnstageRequest(adapter_id="good"), timeout=30)
    try:
        state = node_state(stub, node)
        code, got = refused(lambda: stub.Promote(fabric_pb2.PromoteRequest(adapter_id="good", peer=liar, name=f"liar-{mode}"), timeout=60))
        assert code == grpc.StatusCode.DATA_LOSS
        assert isinstance(got, error) and re.search(match, str(got)), got
        assert node_state(stub, node) == state
    finally:
        stage_raw(stub, corpus["good"], "good")


# ---------------------------------------------------------------- Stage streams that break the protocol


def _stream(corpus: dict[str, Path], name: str) -> tuple[list[fabric_pb2.StageRequest], type[FabricError], str, grpc.StatusCode]:
    good = corpus["good"]
    data = (good / WEIGHTS).read_bytes()
    begin = begin_for(good, f"stream/{name}")
    invalid, busy = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED
    # begin_offset_ahead: a node holding none of the bytes cannot tell "never sent" from "committed by another stream
    # meanwhile"; both are resolved by asking UploadOffset again, so both are Busy (issue 18, item 9).
    cases = {
        "more_bytes_than_announced": ([begin, *data_messages(data + b"\0" * 100)], InvalidArgument, r"beyond the declared size", invalid),
        "data_before_begin": ([*data_messages(data), begin], InvalidArgument, r"data before its StageBegin", invalid),
        "second_begin": ([begin, begin, *data_messages(data)], InvalidArgument, r"second StageBegin", invalid),
        "empty_message": ([begin, fabric_pb2.StageRequest()], InvalidArgument, r"empty StageRequest", invalid),
        "no_begin": ([], InvalidArgument, r"ended without a StageBegin", invalid),
        "offset_gap": ([begin, *data_messages(data)[1:]], InvalidArgument, r"expected offset 0", invalid),
        "offset_repeated": ([begin, *data_messages(data)[:1], *data_messages(data)], InvalidArgument, r"data at offset 0, expected offset 4096", invalid),
        "declared_root_lies": (
            [begin_for(good, f"stream/{name}", weights_root="ab" * 32), *data_messages(data)],
            IntegrityError,
            r"declared abab",
            grpc.StatusCode.DATA_LOSS,
        ),
        "declared_root_not_hex": ([begin_for(good, f"stream/{name}", weights_root="xyz"), *data_messages(data)], InvalidArgument, r"weights_root .*'xyz' is not a digest", invalid),
        "declared_blake3_not_hex": ([begin_for(good, f"stream/{name}", safetensors_blake3="xyz"), *data_messages(data)], InvalidArgument, r"safetensors_blake3 'xyz' is not a digest", invalid),
        "digest_scheme_unset": (
            [begin_for(good, f"stream/{name}", digest_scheme=0), *data_messages(data)],
            IncompatibleFormat,
            r"digest scheme 1 .*scheme 2",
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        "begin_offset_ahead": ([begin_for(good, f"stream/{name}", offset=4096), *data_messages(data[4096:], 4096)], Busy, r"ask UploadOffset", busy),
        "config_json_garbage": ([begin_for(good, f"stream/{name}", config_json=b"\xff\xfe"), *data_messages(data)], InvalidConfig, r"not valid UTF-8", invalid),
        "size_smaller_than_data": (
            [begin_for(good, f"stream/{name}", safetensors_size=len(data) - 1), *data_messages(data)],
            InvalidArgument,
            r"beyond the declared size",
            invalid,
        ),
    }
    return cases[name]


STREAM_CASES = [
    "more_bytes_than_announced",
    "data_before_begin",
    "second_begin",
    "empty_message",
    "no_begin",
    "offset_gap",
    "offset_repeated",
    "declared_root_lies",
    "declared_root_not_hex",
    "declared_blake3_not_hex",
    "digest_scheme_unset",
    "begin_offset_ahead",
    "config_json_garbage",
    "size_smaller_than_data",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", STREAM_CASES)
def test_malformed_stage_stream_commits_nothing(name, corpus, nodes, stub) -> None:
    messages, error, match, code = _stream(corpus, name)
    node = nodes[1]
    state = node_state(stub, node, committed_only=True)
    got_code, got = refused(lambda: stub.Stage(iter(messages), timeout=30))
    assert got_code == code
    assert isinstance(got, error) and re.search(match, str(got)), f"{type(got).__name__}: {got}"
    assert node_state(stub, node, committed_only=True) == state


@pytest.mark.slow
def test_stage_stream_that_ends_early_commits_nothing_then_resumes(corpus, nodes, stub) -> None:
    from adapter_fabric.client.node_client import NodeClient

    good, node = corpus["good"], nodes[1]
    data = (good / WEIGHTS).read_bytes()
    state = node_state(stub, node, committed_only=True)
    half = len(data) // 2 // PIECE * PIECE
    code, error = refused(lambda: stub.Stage(iter([begin_for(good, "stream/early"), *data_messages(data[:half])]), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "send the rest first" in str(error)
    assert node_state(stub, node, committed_only=True) == state
    key = blake3_of(good / WEIGHTS)
    assert stub.UploadOffset(fabric_pb2.UploadOffsetRequest(adapter_id="stream/early", safetensors_blake3=key), timeout=30).offset == half
    with NodeClient(node.address) as client:
        reply = client.stage(good, "stream/early")
    assert reply.bytes_received == len(data) - half
    assert "stream/early" in {s.adapter_id for s in stub.ListAdapters(fabric_pb2.ListAdaptersRequest(), timeout=30).staged}
    stub.Unstage(fabric_pb2.UnstageRequest(adapter_id="stream/early"), timeout=30)


# ---------------------------------------------------------------- callers of another digest scheme


@pytest.mark.slow
def test_callers_of_digest_scheme_1_are_refused_by_name_and_change_nothing(corpus, nodes, stub) -> None:
    """What a scheme-1 client or peer sends (no digest_scheme, no BLAKE3 key): FAILED_PRECONDITION naming both schemes."""
    node = nodes[1]
    state = node_state(stub, node)
    calls = {
        "GetManifest": lambda: stub.GetManifest(fabric_pb2.GetManifestRequest(adapter_id="good"), timeout=30),
        "UploadOffset": lambda: stub.UploadOffset(fabric_pb2.UploadOffsetRequest(adapter_id="good"), timeout=30),
        "Stage": lambda: stub.Stage(iter([begin_for(corpus["good"], "old/client", digest_scheme=0)]), timeout=30),
    }
    for method, call in calls.items():
        code, error = refused(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, method
        assert isinstance(error, IncompatibleFormat) and re.search(r"scheme 1 .*scheme 2", str(error)), f"{method}: {error}"
    assert node_state(stub, node) == state
