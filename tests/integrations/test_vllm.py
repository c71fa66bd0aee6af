"""The vLLM hand-off against vLLM's own code: its plugin loader, resolver registry and OpenAI serving layer.

scripts/bootstrap.sh installs the pinned vLLM (``VLLM_TESTED``) without its
dependencies; these tests skip, saying why, when it could not. Each case runs
``tests/support/vllm_probe.py`` in a process of its own (vLLM loads plugins
once per process), configured through the FABRIC_* variables as an engine
container is, against real node processes: only vLLM's engine core is
replaced. The processes are forked from one that has imported vLLM already
(``vllm_probe.py --serve``): its imports are nearly all of a probe's CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.integrations.vllm_resolver import RESOLVER_NAME
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.export import version_name
from adapter_fabric.store.manifest import CONFIG_FILE
from tests.support import ROOT

VLLM_MISSING = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(VLLM_MISSING, reason="vLLM is not installed here (scripts/bootstrap.sh could not install it; see its output)"),
]

PROBE = ROOT / "tests" / "support" / "vllm_probe.py"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    directory = make_peft_adapter(tmp_path_factory.mktemp("vllm") / "a", base_model=build_tiny_model(), r=8, target_modules=["q_proj", "v_proj"], seed=7)
    config = json.loads((directory / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "tiny"  # what vLLM's served model is called here
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, adapter):
    """A seed holding the adapter and a store-only sidecar exporting what it holds, as beside an engine."""
    root = tmp_path_factory.mktemp("vllm-cluster")
    seed = LocalNode(root / "seed", model="none", port=free_port()).start()
    export = root / "export"
    sidecar = LocalNode(root / "sidecar", model="none", port=free_port(), peers=[seed.address], extra_args=["--export-dir", str(export)]).start()
    with seed.client() as client:
        client.stage(adapter, "team-a/support")
    yield seed, sidecar, export
    sidecar.stop()
    seed.stop()


CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
# vLLM's own log handler on stderr (it writes to stdout by default): "log" is what vLLM's log shows
LOGS = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_PLUGINS": "fabric_lora_resolver"}


class Probes:
    """``vllm_probe.py --serve``: each ``run`` is one probe process, forked from the server, with this environment."""

    def __init__(self, scratch: Path) -> None:
        self.scratch, self.count = scratch, 0
        self.server = subprocess.Popen([sys.executable, str(PROBE), "--serve"], env={**CLEAN, **LOGS}, cwd=ROOT, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip

    def run(self, env: dict[str, str], *args: str) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of one probe."""
        self.count += 1
        out, err = self.scratch / f"{self.count}.out", self.scratch / f"{self.count}.err"
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(json.dumps({"args": list(args), "env": env, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        assert reply, f"the probe server ended (rc {self.server.wait()})"
        return json.loads(reply)["rc"], out.read_text(), err.read_text()

    def close(self) -> None:
        if self.server.stdin:
            self.server.stdin.close()
        self.server.wait(timeout=60)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    server = Probes(tmp_path_factory.mktemp("probes"))
    yield server
    server.close()


def probe(probes: Probes, env: dict[str, str], *args: str) -> dict:
    rc, out, err = probes.run({**CLEAN, **LOGS, **env}, *args)
    assert rc == 0, f"vLLM did not get through (rc {rc}): {err[-3000:]}"
    return {**json.loads(out.strip().splitlines()[-1]), "log": err}


def test_the_plugin_is_found_through_its_entry_point_and_resolves_a_pull_from_a_peer(cluster, probes) -> None:
    _, sidecar, export = cluster
    answer = probe(probes, {"FABRIC_EXPORT_DIR": str(export), "FABRIC_NODE": sidecar.address}, "tiny", "team-a/support")
    assert RESOLVER_NAME in answer["registered"]
    assert answer["kind"] == "lora" and answer["added"] == 1, answer
    with sidecar.client() as client:
        assert "team-a/support" in [a.adapter_id for a in client.list().staged]  # pulled from the seed on the miss
        digest = client.manifest("team-a/support").digest
    # the entry named by the digest: vLLM keys its prefix cache by (name, path), so a new digest is a new path
    assert Path(answer["path"]) == export / version_name("team-a/support", digest) and (Path(answer["path"]) / CONFIG_FILE).is_file()


def test_an_unreachable_node_gives_vllms_404_not_a_500(cluster, probes, tmp_path) -> None:
    (tmp_path / "export").mkdir()
    env = {"FABRIC_EXPORT_DIR": str(tmp_path / "export"), "FABRIC_NODE": f"127.0.0.1:{free_port()}", "FABRIC_RESOLVE_TIMEOUT": "5"}
    answer = probe(probes, env, "tiny", "team-a/support")
    assert answer["kind"] == "error" and answer["code"] == 404, answer
    assert "PeerUnavailable" in answer["log"]  # logged with its type


def test_a_wrong_base_model_is_refused_without_a_pull(cluster, probes, tmp_path) -> None:
    seed, _, _ = cluster
    export = tmp_path / "export"
    fresh = LocalNode(tmp_path / "fresh", model="none", port=free_port(), peers=[seed.address], extra_args=["--export-dir", str(export)]).start()
    try:
        answer = probe(probes, {"FABRIC_EXPORT_DIR": str(export), "FABRIC_NODE": fresh.address}, "another-model", "team-a/support")
        assert answer["kind"] == "error" and answer["code"] == 404, answer
        # said in vLLM's own log (it was a bare 404): which model the adapter is for, and what to set
        assert "is for base model 'tiny'" in answer["log"] and "FABRIC_BASE_MODEL" in answer["log"], answer["log"]
        with fresh.client() as client:
            assert client.list().staged == [] and client.store_status().partials == []  # not a byte moved
    finally:
        fresh.stop()


def test_the_base_model_match_follows_what_operators_write(cluster, probes, tmp_path) -> None:
    """vLLM hands resolvers its model path: /models/Tiny is the adapter's "tiny" (the directory's name, without case);
    /models/base is not, until FABRIC_BASE_MODEL names it (the sidecar manifest's layout)."""
    seed, _, _ = cluster
    export = tmp_path / "export"
    fresh = LocalNode(tmp_path / "fresh", model="none", port=free_port(), peers=[seed.address], extra_args=["--export-dir", str(export)]).start()
    try:
        env = {"FABRIC_EXPORT_DIR": str(export), "FABRIC_NODE": fresh.address}
        assert probe(probes, env, "/models/base", "team-a/support")["code"] == 404
        answer = probe(probes, {**env, "FABRIC_BASE_MODEL": "other,tiny"}, "/models/base", "team-a/support")
        assert answer["kind"] == "lora", answer
        assert "base model also named other, tiny" in answer["log"]  # the registration is in vLLM's log too
        assert probe(probes, env, "/models/Tiny", "team-a/support")["kind"] == "lora"
    finally:
        fresh.stop()


def test_the_export_name_is_not_a_second_name_for_the_adapter(cluster, probes) -> None:
    _, sidecar, export = cluster
    answer = probe(probes, {"FABRIC_EXPORT_DIR": str(export), "FABRIC_NODE": sidecar.address}, "tiny", "team-a%2Fsupport")
    assert answer["kind"] == "error" and answer["code"] == 404, answer


BAD_SETTINGS = {
    "FABRIC_AUTH_TOKEN_FILE": "/nonexistent/token",
    "FABRIC_RESOLVE_TIMEOUT": "nan",
    "FABRIC_NODE": "no-port",
    "FABRIC_TLS_CA": "/nonexistent/ca.pem",
    "FABRIC_EXPORT_DIR": "/nonexistent/export",
}


def test_a_bad_setting_leaves_vllm_starting_without_the_resolver(cluster, probes) -> None:
    """One vLLM start per bad variable (vLLM's loader run from scratch each time, in one process to save imports)."""
    _, sidecar, export = cluster
    good = {"FABRIC_EXPORT_DIR": str(export), "FABRIC_NODE": sidecar.address}
    cases = [good] + [{**good, name: value} for name, value in BAD_SETTINGS.items()]
    rc, out, err = probes.run(CLEAN, "--starts", json.dumps(cases))
    assert rc == 0, f"vLLM did not start (rc {rc}): {err[-3000:]}"
    first, *bad = json.loads(out.strip().splitlines()[-1])
    assert RESOLVER_NAME in first["registered"]  # the loop itself registers a good configuration
    for name, answer in zip(BAD_SETTINGS, bad):
        assert RESOLVER_NAME not in answer["registered"], name
        assert "not registered" in answer["log"] and name in answer["log"], (name, answer["log"])


def test_without_an_export_dir_the_plugin_stays_out_of_the_way_and_says_why_in_vllms_log(probes) -> None:
    answer = probe(probes, {})
    assert RESOLVER_NAME not in answer["registered"]
    assert "FABRIC_EXPORT_DIR is not set" in answer["log"] and "WARNING" in answer["log"], answer["log"]  # VLLM_PLUGINS asked for it
