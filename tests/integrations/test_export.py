"""The export directory (--export-dir) and the vLLM resolver's lookup-and-pull, on real stores and nodes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.integrations.vllm_resolver import resolve
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.adapter_store import AdapterStore
from adapter_fabric.store.export import adapter_id_of, export_name, version_name
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE

PROMPT = torch.tensor([[1, 17, 42, 99, 5, 23]])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("adapters"), build_tiny_model()
    made = {name: make_peft_adapter(root / name, base_model=base, r=r, target_modules=["q_proj", "v_proj", "down_proj"], seed=seed) for name, r, seed in (("a", 8, 3), ("b", 4, 4))}
    for directory in made.values():  # a model built in code has no name; engines match on this field
        config = (directory / CONFIG_FILE).read_text().replace('"base_model_name_or_path": null', '"base_model_name_or_path": "tiny"')
        (directory / CONFIG_FILE).write_text(config)
    return made


def peft_logits(adapter_dir: Path) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(build_tiny_model(), adapter_dir).eval()
    with torch.no_grad():
        return model(PROMPT).logits


def names(export: Path) -> list[str]:
    """The adapter entries (removed ones wait out their grace period under a %old- name)."""
    return sorted(p.name for p in export.iterdir() if not p.name.startswith("%"))


def test_names_map_slash_reversibly() -> None:
    assert export_name("team-a/support-v3") == "team-a%2Fsupport-v3"
    assert adapter_id_of("team-a%2Fsupport-v3") == "team-a/support-v3" and adapter_id_of("plain") == "plain"


def test_staged_adapters_appear_as_peft_dirs_of_hard_links_with_parity(tmp_path: Path, adapters) -> None:
    store = AdapterStore(tmp_path / "store", export_dir=tmp_path / "export")
    manifest = store.stage(adapters["a"], "team-a/a")
    exported = tmp_path / "export" / "team-a%2Fa"
    assert sorted(p.name for p in exported.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    for entry in manifest.files:  # no copy: the same inodes as the store's blobs
        assert os.path.samefile(exported / entry.name, store.blob_path(entry.root))
    assert torch.allclose(peft_logits(exported), peft_logits(adapters["a"]), atol=0, rtol=0)


def test_unstage_removes_and_restage_replaces_and_restart_resyncs(tmp_path: Path, adapters) -> None:
    export = tmp_path / "export"
    store = AdapterStore(tmp_path / "store", export_dir=export)
    store.stage(adapters["a"], "x")
    store.stage(adapters["b"], "y")
    store.stage(adapters["b"], "x")  # the same id, other bytes: the entry is swapped
    assert (export / "x" / WEIGHTS_FILE).read_bytes() == (adapters["b"] / WEIGHTS_FILE).read_bytes()
    store.unstage("y")
    assert names(export) == ["x"]
    # Behind the node's back: an entry lost, a stale one left. A restart puts both right.
    store2 = AdapterStore(tmp_path / "store")  # a store without exports does not touch the directory
    store2.stage(adapters["a"], "z")
    (export / "stale").mkdir()
    for p in (export / "x").iterdir():
        p.unlink()
    (export / "x").rmdir()
    AdapterStore(tmp_path / "store", export_dir=export)
    assert names(export) == ["x", "z"]


def test_entries_appear_whole_or_not_at_all(tmp_path: Path, adapters) -> None:
    """A reader listing the directory while adapters are staged and unstaged never sees a half-built entry,
    nor one emptied under it (removed entries keep their files for a grace period)."""
    export = tmp_path / "export"
    store = AdapterStore(tmp_path / "store", export_dir=export)
    sizes = {name: (d / WEIGHTS_FILE).stat().st_size for name, d in adapters.items()}
    stop, seen, torn = threading.Event(), [0], []

    def reader() -> None:
        while not stop.is_set():
            for entry in os.scandir(export):
                if entry.name.startswith("%"):
                    continue  # a temp or trash name: never a valid adapter name
                try:
                    files = {p.name: p.stat().st_size for p in Path(entry.path).iterdir()}
                except FileNotFoundError:
                    continue  # removed between listing and reading: gone whole
                seen[0] += 1
                if set(files) != {CONFIG_FILE, WEIGHTS_FILE} or files[WEIGHTS_FILE] not in sizes.values():
                    torn.append((entry.name, files))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            store.stage(adapters["a" if i % 2 else "b"], f"churn/{i % 4}")
            if i % 3 == 0:
                store.unstage(f"churn/{i % 4}")
    finally:
        stop.set()
        thread.join()
    assert seen[0] > 0 and torn == []


def test_an_export_dir_the_store_cannot_link_into_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises((InvalidArgument, OSError)):
        AdapterStore(tmp_path / "store", export_dir=tmp_path / "file")


@pytest.mark.slow
def test_resolver_pulls_from_a_peer_and_returns_a_dir_peft_loads(tmp_path: Path, adapters) -> None:
    """The vLLM sidecar: a store-only node beside the engine pulls on a miss; the engine gets its exported directory."""
    with LocalNode(tmp_path / "seed", model="none") as seed:
        with seed.client() as client:
            client.stage(adapters["a"], "team-a/support")
        export = tmp_path / "sidecar-export"
        with LocalNode(tmp_path / "sidecar", model="none", peers=[seed.address], extra_args=["--export-dir", str(export)]) as sidecar:
            assert resolve(sidecar.address, "team-a/missing", "tiny", export) is None  # no peer holds it
            path = resolve(sidecar.address, "team-a/support", "tiny", export)
            with sidecar.client() as client:
                assert [a.adapter_id for a in client.list().staged] == ["team-a/support"]
                digest = client.manifest("team-a/support").digest
            assert path == export / version_name("team-a/support", digest)  # the entry of this digest: a new digest is a new path
            assert torch.allclose(peft_logits(path), peft_logits(adapters["a"]), atol=0, rtol=0)
            # One name per adapter: the escaped export name is not resolved (vLLM would hold two LoRAs for one directory);
            # a base model it was not made for is no match (as vLLM's own resolver).
            assert resolve(sidecar.address, "team-a%2Fsupport", "tiny", export) is None
            assert resolve(sidecar.address, "team-a/support", "another-model", export) is None
            assert resolve(sidecar.address, "../escape", "tiny", export) is None
            with sidecar.client() as client:
                client.unstage("team-a/support")
            assert not path.exists()


def test_removed_entries_are_deleted_after_their_grace_period(tmp_path: Path, adapters, monkeypatch) -> None:
    from adapter_fabric.store import export as export_module

    store = AdapterStore(tmp_path / "store", export_dir=tmp_path / "export")
    store.stage(adapters["a"], "x")
    store.unstage("x")
    assert [p.name[:5] for p in (tmp_path / "export").iterdir()] == ["%old-"]  # still readable by whoever opened it
    monkeypatch.setattr(export_module, "GRACE_S", 0.0)
    store.stage(adapters["a"], "y")
    store.unstage("y")
    assert list((tmp_path / "export").iterdir()) == []


def test_the_vllm_plugin_reads_its_connection_from_the_fabric_variables(tmp_path: Path, monkeypatch) -> None:
    """What register() hands resolve(): the same variables as the fabric command (register itself: tests/integrations/test_vllm.py)."""
    from adapter_fabric.integrations.vllm_resolver import settings_from_env, lora_int_id

    for name in ("FABRIC_TLS_CERT", "FABRIC_TLS_KEY", "FABRIC_TLS_CA", "FABRIC_AUTH_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert settings_from_env() == {"tls": None, "token": None}
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("FABRIC_TLS_CA", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("FABRIC_AUTH_TOKEN_FILE", str(tmp_path / "token"))
    settings = settings_from_env()
    assert settings["token"] == "s3cret" and settings["tls"].ca == tmp_path / "ca.pem" and settings["tls"].cert is None
    assert lora_int_id("team-a/x") == lora_int_id("team-a/x") > 0 and lora_int_id("team-a/x") != lora_int_id("team-a/y")


def test_a_version_entry_holds_one_digest_and_goes_when_the_id_moves_or_goes(tmp_path: Path, adapters) -> None:
    """What the vLLM resolver hands vLLM: <id>#<digest prefix>, never other bytes; set aside when the id moves on or is unstaged."""
    store = AdapterStore(tmp_path / "store", export_dir=tmp_path / "export")
    first = store.stage(adapters["a"], "team-a/x")
    old = store.export_version("team-a/x", first)
    assert old.name == version_name("team-a/x", first.digest) and (old / "adapter_model.safetensors").read_bytes() == (adapters["a"] / "adapter_model.safetensors").read_bytes()
    assert store.export_version("team-a/x", first) == old  # made once
    second = store.stage(adapters["b"], "team-a/x")  # the id moves to other bytes
    assert not old.exists() and (tmp_path / "export" / export_name("team-a/x")).is_dir()
    new = store.export_version("team-a/x", second)
    assert new != old and adapter_id_of(new.name) == "team-a/x"
    store.unstage("team-a/x")
    assert not new.exists() and not [p for p in (tmp_path / "export").iterdir() if not p.name.startswith("%old-")]
