"""Issue 13: signed adapters. A node started with --trusted-signers stages, pulls, loads and serves only adapters whose
manifest digest a trusted key signed; each refusal comes before any byte moves and leaves its state unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from adapter_fabric.cli.main import run as cli
from adapter_fabric.errors import FabricError, Untrusted
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.store import flip_byte
from adapter_fabric.trust.signing import TrustedSigners, keygen, sign_digest

pytestmark = pytest.mark.timeout(300)

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    paths = {}
    for who in ("author", "stranger"):
        private, public = keygen()
        (root / f"{who}.key").write_bytes(private)
        (root / f"{who}.pub").write_bytes(public)
        paths[who] = root / f"{who}.key"
        paths[f"{who}.pub"] = root / f"{who}.pub"
    return paths


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("signed-adapters")
    base = build_tiny_model()
    return {n: make_peft_adapter(root / n, base_model=base, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=s) for s, n in ((51, "x"), (52, "y"), (53, "z"))}


def store_files(store: Path) -> dict[str, int]:
    """Every file a refusal could have touched (committed state), with its size."""
    found = {}
    for top in ("blobs", "manifests", "refs", "signatures"):
        for dirpath, _, names in os.walk(store / top):
            for name in names:
                path = Path(dirpath) / name
                found[str(path.relative_to(store))] = path.stat().st_size
    return found


def test_signatures_verify_only_for_the_key_and_the_digest(keys) -> None:
    trusted = TrustedSigners.from_files([keys["author.pub"]])
    digest = "ab" * 32
    signature = sign_digest(keys["author"].read_bytes(), digest)
    trusted.check(digest, signature, "x")
    with pytest.raises(Untrusted, match="not signed"):
        trusted.check(digest, b"", "x")
    with pytest.raises(Untrusted):
        trusted.check("cd" * 32, signature, "x")  # a tampered manifest has another digest
    with pytest.raises(Untrusted):
        trusted.check(digest, sign_digest(keys["stranger"].read_bytes(), digest), "x")
    TrustedSigners().check(digest, b"", "x")  # no trusted signers: nothing required


@pytest.mark.slow
def test_a_trusting_node_stages_only_signed_adapters(tmp_path, keys, adapters) -> None:
    node = LocalNode(tmp_path / "n", slots=2, extra_args=["--trusted-signers", str(keys["author.pub"])]).start()
    try:
        with node.client() as c:
            for sign_key in (None, keys["stranger"].read_bytes()):  # unsigned, wrong key
                before = store_files(node.store)
                with pytest.raises(Untrusted):
                    c.stage(adapters["x"], "x", sign_key=sign_key)
                assert store_files(node.store) == before and not c.list().staged
                assert not any((node.store / "uploads").iterdir()), "a refused Stage wrote upload bytes"
            reply = c.stage(adapters["x"], "x", sign_key=keys["author"].read_bytes())
            c.promote("x")
            assert len(c.generate(PROMPT, "x", max_new_tokens=2).output_ids) == 2
            assert c.manifest_proto("x").signature  # it travels with the manifest
            assert reply.digest
    finally:
        node.stop()


@pytest.mark.slow
def test_a_trusting_node_pulls_only_signed_adapters(tmp_path, keys, adapters) -> None:
    # The seed trusts no one: it holds an unsigned adapter, a signed one, and one carrying another digest's signature.
    seed = LocalNode(tmp_path / "seed", model="none", slots=2).start()  # it stages and serves: no model
    node = LocalNode(tmp_path / "n", slots=2, port=free_port(), extra_args=["--trusted-signers", str(keys["author.pub"])]).start()
    try:
        with seed.client() as s, node.client() as c:
            s.stage(adapters["y"], "unsigned")
            s.stage(adapters["x"], "signed", sign_key=keys["author"].read_bytes())
            s.stage(adapters["z"], "other", sign_key=keys["stranger"].read_bytes())

            def refused(adapter_id: str) -> None:
                before = store_files(node.store)
                with pytest.raises(Untrusted):
                    c.promote(adapter_id, peer=seed.address)
                with pytest.raises(Untrusted):
                    c.promote(adapter_id, peer=seed.address, stage_only=True)
                assert store_files(node.store) == before and not c.list().staged
                assert not any((node.store / "partial").iterdir()), "a refused pull moved bytes"

            refused("unsigned")
            refused("other")  # signed by a key this node does not trust
            # A tampered manifest: z's files carrying x's signature (signed for x's digest).
            (seed.store / "signatures" / s.manifest_proto("other").digest).write_bytes(s.manifest_proto("signed").signature)
            refused("other")
            c.promote("signed", peer=seed.address)
            assert [a.adapter_id for a in c.list().staged] == ["signed"]
    finally:
        node.stop()
        seed.stop()


@pytest.mark.slow
def test_tampered_bytes_of_a_signed_adapter_are_refused(tmp_path, keys, adapters) -> None:
    seed = LocalNode(tmp_path / "seed", model="none", slots=2).start()  # it stages and serves: no model
    node = LocalNode(tmp_path / "n", slots=2, extra_args=["--trusted-signers", str(keys["author.pub"])]).start()
    try:
        with seed.client() as s, node.client() as c:
            s.stage(adapters["x"], "x", sign_key=keys["author"].read_bytes())
            root = json.loads((seed.store / "manifests" / f"{s.manifest_proto('x').digest}.json").read_bytes())["files"][1]["root"]
            flip_byte(seed.store / "blobs" / "blake3" / root[:2] / root, -1)
            before = store_files(node.store)
            with pytest.raises(FabricError):
                c.promote("x", peer=seed.address, named_peer_only=True)
            assert store_files(node.store) == before and not c.list().staged
    finally:
        node.stop()
        seed.stop()


@pytest.mark.slow
def test_a_trusting_node_serves_only_signed_adapters_it_holds(tmp_path, keys, adapters) -> None:
    """Adapters staged before the node trusted signers are neither loaded nor served once it does."""
    port = free_port()
    node = LocalNode(tmp_path / "n", model="none", slots=2, port=port).start()  # it only stages
    with node.client() as c:
        c.stage(adapters["x"], "old")
    node.stop()
    node = LocalNode(tmp_path / "n", slots=2, port=port, extra_args=["--trusted-signers", str(keys["author.pub"])]).start()
    try:
        with node.client() as c:
            with pytest.raises(Untrusted):
                c.promote("old")
            with pytest.raises(Untrusted):
                c.manifest("old")
    finally:
        node.stop()


def test_keygen_and_sign_commands(tmp_path, keys, adapters, capsys) -> None:
    assert cli(["keygen", str(tmp_path / "me")]) == 0
    assert (tmp_path / "me.key").stat().st_mode & 0o777 == 0o600
    capsys.readouterr()
    assert cli(["sign", str(adapters["x"]), "--key", str(tmp_path / "me.key"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    TrustedSigners.from_files([tmp_path / "me.pub"]).check(out["digest"], bytes.fromhex(out["signature"]), "x")
