"""Issue 28 (6): a digest's signer places cannot be squatted, with real node processes.

A policy node: mallory may publish under ``mallory/`` only. It stages the bytes
team-a publishes, signed with throwaway keys: it takes at most
``MAX_SIGNERS_PER_PRINCIPAL`` places, team-a's author still signs, and mallory's
places go with its last id. A node trusting two authors holds an adapter whose
places are full of untrusted signatures (pulled from a relay that keeps
anyone's): the second author's signature still gets a place there.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.errors import TooManySigners
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc import security
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.digests import CONFIG_FILE, WEIGHTS_FILE, adapter_digest, hash_bytes
from adapter_fabric.store.signatures import MAX_SIGNERS_PER_PRINCIPAL
from adapter_fabric.trust.signing import MAX_SIGNERS, keygen, sign, signatures_from_proto
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.store import stage_begin

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-6e3a", "mallory": "mallory-token-90f1", "team-a": "team-a-token-2d45"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("adapters") / "x", base_model=build_tiny_model(), r=4, target_modules=["q_proj", "v_proj"], seed=71)


def digest_of(adapter_dir: Path) -> str:
    config, weights = (adapter_dir / CONFIG_FILE).read_bytes(), (adapter_dir / WEIGHTS_FILE).read_bytes()
    return adapter_digest(hash_bytes(CONFIG_FILE, config, 1 << 20).root, hash_bytes(WEIGHTS_FILE, weights, 1 << 20).root)


def stage(node: LocalNode, adapter_dir: Path, adapter_id: str, private: bytes, token: str | None = None) -> fabric_pb2.StageResponse:
    """A Stage signed with ``private``, as ``token``'s principal (the cluster's by default)."""
    signed = sign(private, digest_of(adapter_dir))
    begin = stage_begin(adapter_dir, adapter_id, signature=signed.signature, signer_public_key=signed.public_key)
    data = (adapter_dir / WEIGHTS_FILE).read_bytes()
    messages = [fabric_pb2.StageRequest(begin=begin), fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=0, data=data))]
    stub = fabric_pb2_grpc.FabricStub(security.channel(node.address, token=token or read(node)))
    try:
        return stub.Stage(iter(messages), timeout=60)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


def read(node: LocalNode) -> str | None:
    return node.token_file.read_text().strip() if node.token_file is not None else None


def signers_of(node: LocalNode, adapter_id: str) -> set[bytes]:
    with node.client() as c:
        return {s.public_key for s in signatures_from_proto(c.manifest_proto(adapter_id))}


def test_a_principal_takes_few_places_and_they_go_with_its_last_id(tmp_path, adapter) -> None:
    root = tmp_path
    (root / "cluster.token").write_text(TOKENS["cluster"])
    (root / "policy.toml").write_text(f"""
[[principal]]
name = "mallory"
token_sha256 = "{token_sha256(TOKENS['mallory'])}"
grants = [{{ verbs = ["read", "publish", "unstage"], prefixes = ["mallory/"] }}]

[[principal]]
name = "team-a"
token_sha256 = "{token_sha256(TOKENS['team-a'])}"
grants = [{{ verbs = ["read", "publish"], prefixes = ["team-a/"] }}]
""")
    throwaway = [keygen()[0] for _ in range(MAX_SIGNERS)]
    author = keygen()[0]
    with LocalNode(root / "n", model="none", token_file=root / "cluster.token", extra_args=["--policy", str(root / "policy.toml")]) as node:
        refused = None
        for i, key in enumerate(throwaway):
            try:
                stage(node, adapter, f"mallory/{i}", key, TOKENS["mallory"])
            except TooManySigners as exc:
                refused = (i, str(exc))
                break
        assert refused is not None and refused[0] == MAX_SIGNERS_PER_PRINCIPAL, refused
        assert "principal 'mallory'" in refused[1], refused[1]
        stage(node, adapter, "team-a/x", author, TOKENS["team-a"])  # the author still signs the bytes it publishes
        mallorys = {sign(k, "00" * 32).public_key for k in throwaway[:MAX_SIGNERS_PER_PRINCIPAL]}
        author_key = sign(author, "00" * 32).public_key
        assert signers_of(node, "team-a/x") == mallorys | {author_key}
        with node.client() as admin:
            for i in range(MAX_SIGNERS_PER_PRINCIPAL):
                admin.unstage(f"mallory/{i}")
        assert signers_of(node, "team-a/x") == {author_key}  # mallory's places went with its last id
        stage(node, adapter, "mallory/again", throwaway[-1], TOKENS["mallory"])  # and are free again
        assert signers_of(node, "team-a/x") == {author_key, sign(throwaway[-1], "00" * 32).public_key}


def test_a_trusted_signer_always_gets_a_place(tmp_path, adapter) -> None:
    authors = [keygen() for _ in range(2)]
    for i, (_, public) in enumerate(authors):
        (tmp_path / f"author{i}.pub").write_bytes(public)
    relay = LocalNode(tmp_path / "relay", model="none").start()  # trusts no one, no policy: keeps anyone's signatures
    trusting = LocalNode(
        tmp_path / "trusting", model="none", peers=[relay.address],
        extra_args=["--trusted-signers", str(tmp_path / "author0.pub"), str(tmp_path / "author1.pub")],
    )
    try:
        stage(relay, adapter, "x", authors[0][0])
        for _ in range(MAX_SIGNERS - 1):
            stage(relay, adapter, "x", keygen()[0])
        assert len(signers_of(relay, "x")) == MAX_SIGNERS
        with trusting:
            with trusting.client() as c:
                c.pull("x", peer=relay.address)
            assert len(signers_of(trusting, "x")) == MAX_SIGNERS  # every place taken, most by untrusted signers
            stage(trusting, adapter, "x2", authors[1][0])  # the second trusted author: never refused for want of room
            held = signers_of(trusting, "x2")
            assert len(held) == MAX_SIGNERS and {sign(a[0], "00" * 32).public_key for a in authors} <= held
    finally:
        relay.stop()
