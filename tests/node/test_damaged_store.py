"""Issue 13 cases 1 and 2: bytes at rest re-verified, nothing lost on a damaged store; real node processes.

Each test damages one file of a node's store (stopped or running) the way a
disk, an operator or a crash might, and checks what the node does: it never
loads or serves the damaged bytes, reports the adapter as damaged (never a
node-wide failure), keeps every byte an id or a manifest may still need, and
repairs from a peer where one holds the adapter.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from blake3 import blake3

from adapter_fabric.errors import FabricError, IntegrityError
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.models import reference_logits
from tests.support.store import flip_byte
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [3, 14, 15, 92, 65, 35]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("store-adapters")
    base = build_tiny_model()
    return {
        "a": make_peft_adapter(root / "a", base_model=base, r=8, lora_alpha=16, target_modules=ALL, seed=11),
        "b": make_peft_adapter(root / "b", base_model=base, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=12),
    }


def node_at(store: Path, port: int, peers=(), **kwargs) -> LocalNode:
    """A node with the tiny model; ``model="none"`` where the test promotes and generates nothing there (it starts in half the time)."""
    return LocalNode(store, port=port, slots=2, peers=list(peers), extra_args=["--chunk-size", "4096"], **kwargs)


def manifest_file(store: Path, adapter_id: str) -> Path:
    digest = (store / "refs" / adapter_id).read_text().strip()
    return store / "manifests" / f"{digest}.json"


def weights_blob(store: Path, adapter_id: str) -> Path:
    root = json.loads(manifest_file(store, adapter_id).read_bytes())["files"][1]["root"]
    return store / "blobs" / "blake3" / root[:2] / root


def staged(client) -> dict[str, str]:
    """adapter id -> its damage ("" when sound)."""
    return {a.adapter_id: a.damaged for a in client.list().staged}



def logits(client, name: str) -> list[float]:
    return client.generate(PROMPT, name, return_logits=True).last_logits


# ---------------------------------------------------------------- case 1: bytes at rest


@pytest.mark.parametrize("offset", [-1, 3], ids=["tensor-byte", "header-byte"])
def test_a_byte_flipped_at_rest_is_never_loaded_and_is_repulled(tmp_path, adapters, offset) -> None:
    seed_port, port = free_port(), free_port()
    seed = node_at(tmp_path / "seed", seed_port, model="none").start()
    node = node_at(tmp_path / "node", port, peers=[seed.address]).start()
    try:
        with seed.client() as s, node.client() as c:
            reference = (s.stage(adapters["a"], "a"), reference_logits(adapters["a"], PROMPT))
            c.promote("a", peer=seed.address)
        node.stop()
        flip_byte(weights_blob(node.store, "a"), offset)
        node = node_at(tmp_path / "node", port, peers=[seed.address]).start()
        with node.client() as c:
            # Either the start-up scrub or this promote finds the flipped byte; the bytes come back from the seed.
            reply = c.promote("a")
            assert reply.content_id == reference[0].content_id
            assert logits(c, "a") == pytest.approx(reference[1], abs=1e-5)
            wait_for(lambda: staged(c) == {"a": ""}, "the adapter repaired")
            assert c.availability(reply.digest).complete
        assert "pulling it again" in node.log_path.read_text(), "the node did not say it re-pulled the corrupt adapter"
    finally:
        node.stop()
        seed.stop()


def test_a_byte_flipped_while_running_is_never_served_and_is_reported(tmp_path, adapters) -> None:
    lone = node_at(tmp_path / "lone", free_port()).start()
    other = node_at(tmp_path / "other", free_port(), model="none").start()
    try:
        with lone.client() as c, other.client() as o:
            c.stage(adapters["a"], "a")
            c.stage(adapters["b"], "b")
            c.promote("b")
            flip_byte(weights_blob(lone.store, "a"), -1)
            # A peer asking for it gets no corrupt chunk: the seed re-verifies before serving and refuses.
            with pytest.raises(FabricError):
                o.pull("a", peer=lone.address, named_peer_only=True)
            assert staged(c)["a"], "the damaged adapter is not reported"
            assert staged(c)["b"] == ""
            a_digest = next(x.digest for x in c.list().staged if x.adapter_id == "a")
            with pytest.raises(FabricError):  # no longer announced to peers
                c.availability(a_digest)
            with pytest.raises(IntegrityError, match="'a'"):  # no peer holds it: DATA_LOSS naming the adapter
                c.promote("a")
            assert len(c.generate(PROMPT, "b", max_new_tokens=2).output_ids) == 2  # the rest serves on
    finally:
        other.stop()
        lone.stop()


def test_a_restart_notices_a_corrupt_blob(tmp_path, adapters) -> None:
    port = free_port()
    node = node_at(tmp_path / "n", port, model="none").start()
    with node.client() as c:
        c.stage(adapters["a"], "a")
    node.stop()
    flip_byte(weights_blob(node.store, "a"), -1)
    node = node_at(tmp_path / "n", port, model="none").start()
    try:
        with node.client() as c:
            wait_for(lambda: staged(c).get("a"), "the start-up scrub to report the corrupt blob")
            assert "quarantined" in staged(c)["a"]
    finally:
        node.stop()


# ---------------------------------------------------------------- case 2: damaged files


def _two_adapters(tmp_path, adapters, port):
    node = node_at(tmp_path / "n", port, model="none").start()
    with node.client() as c:
        c.stage(adapters["a"], "a")
        c.stage(adapters["b"], "b")
    node.stop()
    return node


def test_a_truncated_manifest_damages_that_adapter_only_and_loses_nothing(tmp_path, adapters) -> None:
    port = free_port()
    node = _two_adapters(tmp_path, adapters, port)
    blob = weights_blob(node.store, "a")
    path = manifest_file(node.store, "a")
    path.write_bytes(path.read_bytes()[:100])
    for _ in range(2):  # two restarts: recovery runs on each
        node = node_at(tmp_path / "n", port).start()
        try:
            with node.client() as c:
                listed = staged(c)
                assert listed["b"] == "" and "manifest" in listed["a"]
                with pytest.raises(IntegrityError, match="'a'"):
                    c.promote("a")
                c.promote("b")
        finally:
            node.stop()
        assert blob.is_file(), "recovery deleted the weights of an adapter whose manifest is damaged"
    node = node_at(tmp_path / "n", port).start()
    try:
        with node.client() as c:
            c.stage(adapters["a"], "a")  # a re-stage repairs it
            assert staged(c) == {"a": "", "b": ""}
            c.promote("a")
    finally:
        node.stop()


def test_a_damaged_id_entry_keeps_every_byte(tmp_path, adapters) -> None:
    port = free_port()
    node = _two_adapters(tmp_path, adapters, port)
    blob = weights_blob(node.store, "a")
    (node.store / "refs" / "a").write_bytes(b"\xff../../etc/passwd")
    for _ in range(2):
        node = node_at(tmp_path / "n", port).start()
        try:
            with node.client() as c:
                listed = staged(c)
                assert listed["b"] == "" and "id entry" in listed["a"]
                c.promote("b")
        finally:
            node.stop()
        assert blob.is_file()
    node = node_at(tmp_path / "n", port, model="none").start()
    try:
        with node.client() as c:
            c.unstage("a")  # a damaged entry can be removed
            assert staged(c) == {"b": ""}
    finally:
        node.stop()


def test_a_missing_blob_is_reported_and_repulled_from_a_peer(tmp_path, adapters) -> None:
    seed = node_at(tmp_path / "seed", free_port(), model="none").start()
    port = free_port()
    node = node_at(tmp_path / "n", port, peers=[seed.address], model="none").start()
    try:
        with seed.client() as s, node.client() as c:
            s.stage(adapters["a"], "a")
            c.pull("a", peer=seed.address)
        node.stop()
        weights_blob(node.store, "a").unlink()
        node = node_at(tmp_path / "n", port, peers=[seed.address]).start()
        with node.client() as c:
            assert "missing" in staged(c)["a"]
            c.promote("a")  # pulled again from the known peer
            assert staged(c) == {"a": ""}
    finally:
        node.stop()
        seed.stop()


def test_a_damaged_partial_download_is_resumed_without_its_bad_bytes(tmp_path, adapters) -> None:
    seed = node_at(tmp_path / "seed", free_port(), model="none").start()
    port = free_port()
    node = node_at(tmp_path / "n", port, peers=[seed.address], model="none").start()
    try:
        with seed.client() as s:
            reference = (s.stage(adapters["a"], "a"), reference_logits(adapters["a"], PROMPT))
            digest = reference[0].digest
        node.stop()
        # A partial as a crash leaves it, then damaged: every byte garbage.
        partial = node.store / "partial" / digest
        partial.mkdir(parents=True)
        (partial / "manifest.json").write_bytes(manifest_file(seed.store, "a").read_bytes())
        (partial / "data").write_bytes(os.urandom(weights_blob(seed.store, "a").stat().st_size))
        # And one with a damaged manifest of its own.
        junk = node.store / "partial" / ("f" * 64)
        junk.mkdir()
        (junk / "manifest.json").write_bytes(b"{not json")
        node = node_at(tmp_path / "n", port, peers=[seed.address]).start()
        with node.client() as c:
            reply = c.promote("a", peer=seed.address)
            assert reply.content_id == reference[0].content_id
            assert logits(c, "a") == pytest.approx(reference[1], abs=1e-5)
            assert staged(c) == {"a": ""}
    finally:
        node.stop()
        seed.stop()


def test_a_damaged_upload_is_restarted_not_resumed(tmp_path, adapters) -> None:
    import hashlib

    port = free_port()
    node = node_at(tmp_path / "n", port, model="none").start()
    try:
        with node.client() as c:
            c.stage(adapters["b"], "b")
        node.stop()
        weights = (adapters["a"] / "adapter_model.safetensors").read_bytes()
        key = blake3(weights).hexdigest()
        upload = node.store / "uploads" / hashlib.sha256(f"a\0{key}".encode()).hexdigest()
        upload.mkdir(parents=True)
        (upload / "meta.json").write_bytes(b"\0\0garbage")
        (upload / "data").write_bytes(os.urandom(len(weights) // 2))
        node = node_at(tmp_path / "n", port).start()
        with node.client() as c:
            c.stage(adapters["a"], "a")  # the damaged upload is not resumed: its bytes are not trusted
            assert staged(c) == {"a": "", "b": ""}
            c.promote("a")
    finally:
        node.stop()


# ---------------------------------------------------------------- the export directory follows the quarantine


def exported(export: Path) -> list[str]:
    """The export directory's entries (removed ones wait out their grace period under a %old- name)."""
    return sorted(p.name for p in export.iterdir() if not p.name.startswith("%"))


def holds_files_of(entry: Path, adapter: Path) -> bool:
    return all((entry / name).read_bytes() == (adapter / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors"))


@pytest.mark.parametrize("trigger", ["promote", "restart-scrub"])
def test_a_quarantined_blob_takes_its_export_entry_until_it_is_pulled_again(tmp_path, adapters, trigger) -> None:
    """The export entry's hard links share the blob's inode: an engine reading it would load the corrupt bytes."""
    export, port = tmp_path / "export", free_port()
    seed = node_at(tmp_path / "seed", free_port(), model="none").start()

    def start(model: str = "none") -> LocalNode:  # no known peers: nothing repairs the blob behind the test's back
        return LocalNode(tmp_path / "n", port=port, slots=2, model=model, extra_args=["--chunk-size", "4096", "--export-dir", str(export)]).start()

    node = start("tiny" if trigger == "promote" else "none")  # only the promote trigger loads a model
    try:
        with seed.client() as s, node.client() as c:
            s.stage(adapters["a"], "a")
            s.stage(adapters["b"], "b")
            c.pull("a", peer=seed.address)
            c.pull("b", peer=seed.address)
        assert exported(export) == ["a", "b"] and holds_files_of(export / "a", adapters["a"])
        if trigger == "promote":
            flip_byte(weights_blob(node.store, "a"), -1)  # while it runs: the promote re-verifies
            with node.client() as c, pytest.raises(IntegrityError, match="quarantined"):
                c.promote("a")
        else:
            node.stop()
            flip_byte(weights_blob(node.store, "a"), -1)
            node = start()  # the start-up scrub finds it
            with node.client() as c:
                wait_for(lambda: "quarantined" in staged(c)["a"], "the start-up scrub to quarantine the blob")
        # the export follows the quarantine (the store's on_damage hands it to the export's refresh): wait for it, bounded
        wait_for(lambda: exported(export) == ["b"], "the export entry of the quarantined blob to go")
        node.stop()
        node = start()  # a restart neither fails on the quarantined blob nor exports it again
        assert exported(export) == ["b"] and holds_files_of(export / "b", adapters["b"])
        with node.client() as c:
            c.pull("a", peer=seed.address)  # the repair
            assert staged(c) == {"a": "", "b": ""}
        assert exported(export) == ["a", "b"]
        assert holds_files_of(export / "a", adapters["a"]) and holds_files_of(export / "b", adapters["b"])
    finally:
        node.stop()
        seed.stop()
