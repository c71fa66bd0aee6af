"""The CLI and the staging script against real node processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.client.node_client import NodeClient
from fabric.harness.cluster import LocalCluster
from fabric.errors import FabricError
from fabric.serving.tiny import build_tiny_model, make_peft_adapter

ROOT = Path(__file__).resolve().parent.parent


def fabric(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "fabric.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"fabric {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("a") / "cli", base_model=build_tiny_model(), r=16, target_modules="all-linear", seed=9)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cli"), 2, slots=2) as cluster:
        yield [node.address for node in cluster.nodes]


def test_help_of_both_console_scripts() -> None:
    assert "promote" in fabric("--help").stdout
    node_help = subprocess.run([sys.executable, "-m", "node.main", "--help"], capture_output=True, text=True, timeout=60)
    assert node_help.returncode == 0 and "FABRIC_MAX_RANK" in node_help.stdout


def test_stage_promote_ls_generate_unstage(nodes, adapter) -> None:
    seed, puller = nodes
    staged = json.loads(fabric("stage", seed, str(adapter), "--id", "cli/a", "--json").stdout)
    assert len(staged["digest"]) == 64 and staged["already_staged"] is False
    again = json.loads(fabric("stage", seed, str(adapter), "--id", "cli/a", "--json").stdout)
    assert again["already_staged"] is True and again["digest"] == staged["digest"]

    promoted = json.loads(fabric("promote", puller, "--from", seed, "--id", "cli/a", "--name", "a", "--json").stdout)
    assert promoted["digest"] == staged["digest"] and promoted["slot"] in (0, 1)

    listing = json.loads(fabric("ls", puller, "--json").stdout)
    assert [s["adapter_id"] for s in listing["staged"]] == ["cli/a"]
    assert [s["name"] for s in listing["slots"] if s["name"]] == ["a"]
    human = fabric("ls", puller).stdout
    assert "cli/a" in human and "[%d] a" % promoted["slot"] in human

    generated = json.loads(fabric("generate", puller, "--adapter", "a", "--tokens", "1,2,3", "--max-new-tokens", "4", "--json").stdout)
    assert len(generated["output_ids"]) == 4 and generated["content_id"] == int(staged["content_id"])

    removed = json.loads(fabric("unstage", puller, "--id", "cli/a", "--json").stdout)
    assert removed == {"adapter_id": "cli/a", "bytes_removed": True}
    assert json.loads(fabric("ls", puller, "--json").stdout).get("staged", []) == []


def test_errors_exit_1_with_one_clear_line(nodes) -> None:
    result = fabric("promote", nodes[1], "--from", nodes[0], "--id", "missing/one", check=False)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("fabric promote: AdapterNotFound:") and "missing/one" in result.stderr
    bad_id = fabric("unstage", nodes[0], "--id", "../x", check=False)
    assert bad_id.returncode == 1 and "InvalidAdapterId" in bad_id.stderr


def test_staging_script_matches_the_cli(nodes, adapter) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stage_adapter.py"), nodes[0], str(adapter), "--id", "script/a", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with NodeClient(nodes[0]) as client:
        assert json.loads(result.stdout)["digest"] == client.manifest("script/a").digest


def test_interrupted_stage_resumes(nodes, adapter) -> None:
    from fabric.client.node_client import sha256_file
    from fabric.v1 import fabric_pb2

    weights = adapter / "adapter_model.safetensors"
    size, sha = weights.stat().st_size, sha256_file(weights)
    piece = 8 << 10

    with NodeClient(nodes[1]) as client, NodeClient(nodes[1]) as observer:

        def node_holds_some_bytes() -> int:
            request = fabric_pb2.UploadOffsetRequest(adapter_id="resume/a", safetensors_sha256=sha)
            return observer.stub.UploadOffset(request).offset

        def crash_once_the_node_holds_bytes(done: int, total: int) -> None:
            if done >= size // 2:
                for _ in range(200):  # the stream is asynchronous: wait until the node has written some of it
                    if node_holds_some_bytes():
                        raise ConnectionAbortedError("simulated client crash mid-upload")
                    time.sleep(0.05)

        with pytest.raises(FabricError):  # gRPC reports the dead request stream as UNKNOWN
            client.stage(adapter, "resume/a", progress=crash_once_the_node_holds_bytes, piece_size=piece)
        assert "resume/a" not in {a.adapter_id for a in client.list().staged}  # nothing half-committed
        kept = node_holds_some_bytes()
        reply = client.stage(adapter, "resume/a", piece_size=piece)
    assert 0 < kept and reply.bytes_received <= size - kept, "the second upload must resume, not start over"
