"""Issue 18, item 3: signatures are kept per signer, each verified under its signer's key before it is kept.

Real node processes. Whoever may Stage on a node that trusts no one can no
longer replace the signature a trusted key made: garbage, a signature of other
bytes, or one naming no key is refused by name and changes nothing; another
signer's valid signature is kept beside it, and a relay passes every author's
on. A store written before signers were recorded (one ``signatures/<digest>``
file) keeps working, and a digest keeps at most ``MAX_SIGNERS`` signers.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from adapter_fabric.errors import BadSignature, TooManySigners
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.digests import CONFIG_FILE, WEIGHTS_FILE, adapter_digest, hash_bytes
from adapter_fabric.store.signatures import OWNERS
from adapter_fabric.trust.signing import MAX_SIGNERS, keygen, sign, signatures_from_proto
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.store import snapshot, stage_begin

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    for who in ("author", "stranger"):
        private, public = keygen()
        (root / f"{who}.key").write_bytes(private)
        (root / f"{who}.pub").write_bytes(public)
    return {p.name: p for p in root.iterdir()}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    return {n: make_peft_adapter(root / n, base_model=base, r=4, target_modules=["q_proj", "v_proj"], seed=s) for s, n in ((61, "x"), (62, "y"))}


def digest_of(adapter_dir: Path, chunk_size: int = 1 << 20) -> str:
    """The digest a node staging at ``chunk_size`` gives a PEFT directory (what an author signs)."""
    config, weights = (adapter_dir / CONFIG_FILE).read_bytes(), (adapter_dir / WEIGHTS_FILE).read_bytes()
    return adapter_digest(hash_bytes(CONFIG_FILE, config, chunk_size).root, hash_bytes(WEIGHTS_FILE, weights, chunk_size).root)


def raw_stage(node: LocalNode, adapter_dir: Path, adapter_id: str, signature: bytes, public_key: bytes = b"") -> fabric_pb2.StageResponse:
    """A Stage sent as a client could, with whatever signature and key it likes."""
    data = (adapter_dir / WEIGHTS_FILE).read_bytes()
    begin = stage_begin(adapter_dir, adapter_id, signature=signature, signer_public_key=public_key)
    messages = [fabric_pb2.StageRequest(begin=begin), fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=0, data=data))]
    with grpc.insecure_channel(node.address) as channel:
        return fabric_pb2_grpc.FabricStub(channel).Stage(iter(messages), timeout=60)


def refused(node: LocalNode, kind: type, *args) -> str:
    with pytest.raises(grpc.RpcError) as info:
        raw_stage(node, *args)
    error = error_from_rpc(info.value)
    assert isinstance(error, kind), error
    return str(error)


def signers_of(node: LocalNode, adapter_id: str) -> set[bytes]:
    with node.client() as c:
        return {s.public_key for s in signatures_from_proto(c.manifest_proto(adapter_id))}


def public(keys: dict[str, Path], who: str) -> bytes:
    return sign(keys[f"{who}.key"].read_bytes(), "00" * 32).public_key


@pytest.mark.slow
def test_a_signature_cannot_be_replaced_and_every_authors_travels(tmp_path, keys, adapters) -> None:
    seed = LocalNode(tmp_path / "seed", model="none").start()  # trusts no one: anyone may stage here
    relay = LocalNode(tmp_path / "relay", model="none", port=free_port(), extra_args=["--trusted-signers", str(keys["author.pub"])]).start()
    far = LocalNode(tmp_path / "far", model="none", port=free_port(), extra_args=["--trusted-signers", str(keys["stranger.pub"])]).start()
    try:
        digest = digest_of(adapters["x"])
        with seed.client() as s:
            s.stage(adapters["x"], "x", sign_key=keys["author.key"].read_bytes())
        author, stranger = public(keys, "author"), public(keys, "stranger")
        before = snapshot(seed.store)
        other = sign(keys["author.key"].read_bytes(), digest_of(adapters["y"]))  # the author's, for other bytes
        cases = [
            (b"\x07" * 64, author),  # the case: any 64 bytes
            (b"\x07" * 64, stranger),
            (other.signature, author),
            (sign(keys["author.key"].read_bytes(), digest).signature, b""),  # a valid one, naming no key
            (b"\x07" * 63, author),
            (b"", author),  # a key without a signature
        ]
        for signature, key in cases:
            message = refused(seed, BadSignature, adapters["x"], "evil", signature, key)
            assert "evil" in message and "nothing was kept" in message, message
            assert snapshot(seed.store) == before, "a refused signature changed the store"
        # Another signer's valid signature is kept beside the author's, never instead of it.
        signed = sign(keys["stranger.key"].read_bytes(), digest)
        raw_stage(seed, adapters["x"], "evil", signed.signature, signed.public_key)
        assert signers_of(seed, "x") == signers_of(seed, "evil") == {author, stranger}
        # A node trusting the author pulls it under either id, and passes both signatures on.
        with relay.client() as r:
            r.promote("evil", peer=seed.address, stage_only=True)
        assert signers_of(relay, "evil") == {author, stranger}
        assert sorted(p.name for p in (relay.store / "signers" / digest).iterdir() if p.name != OWNERS) == sorted([author.hex(), stranger.hex()])
        with far.client() as f:  # trusts the stranger only: it takes the stranger's signature the relay passed on
            f.promote("evil", peer=relay.address, named_peer_only=True, stage_only=True)
        assert signers_of(far, "evil") == {author, stranger}
    finally:
        for node in (far, relay, seed):
            node.stop()


@pytest.mark.slow
def test_a_store_of_the_old_layout_keeps_its_signature(tmp_path, keys, adapters) -> None:
    """``signatures/<digest>`` (one file, no signer named) is still read: a trusting node takes it and records its signer."""
    seed = LocalNode(tmp_path / "seed", model="none")
    with seed:
        with seed.client() as s:
            digest = s.stage(adapters["x"], "x").digest
    (seed.store / "signatures" / digest).write_bytes(sign(keys["author.key"].read_bytes(), digest).signature)  # as the old code kept it
    puller = LocalNode(tmp_path / "puller", model="none", port=free_port(), extra_args=["--trusted-signers", str(keys["author.pub"])])
    with seed, puller:
        with puller.client() as p:
            p.promote("x", peer=seed.address, stage_only=True)
        assert [f.name for f in (puller.store / "signers" / digest).iterdir() if f.name != OWNERS] == [public(keys, "author").hex()]
        assert signers_of(puller, "x") == {public(keys, "author")}


@pytest.mark.slow
def test_a_digest_keeps_at_most_max_signers(tmp_path, adapters) -> None:
    node = LocalNode(tmp_path / "n", model="none").start()
    try:
        digest = digest_of(adapters["y"])
        signers = [sign(keygen()[0], digest) for _ in range(MAX_SIGNERS + 1)]
        for signed in signers[:MAX_SIGNERS]:
            raw_stage(node, adapters["y"], "y", signed.signature, signed.public_key)
        before = snapshot(node.store)
        message = refused(node, TooManySigners, adapters["y"], "y", signers[-1].signature, signers[-1].public_key)
        assert str(MAX_SIGNERS) in message, message
        assert snapshot(node.store) == before
        raw_stage(node, adapters["y"], "y", signers[0].signature, signers[0].public_key)  # one already kept: still welcome
        assert len(signers_of(node, "y")) == MAX_SIGNERS
    finally:
        node.stop()
