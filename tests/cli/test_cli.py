"""The ``fabric`` command against real node processes: every command, --json (errors too), exit codes, messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalCluster, LocalNode, free_port
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

pytestmark = pytest.mark.slow  # real node processes (the quick tier leaves them out: -m 'not slow')


def fabric(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"fabric {' '.join(args)} exited {result.returncode}: {result.stderr}{result.stdout}")
    assert "Traceback" not in result.stderr, result.stderr
    return result


def fabric_json(*args: str) -> dict:
    return json.loads(fabric(*args, "--json").stdout)


def json_error(*args: str) -> tuple[int, dict]:
    result = fabric(*args, "--json", check=False)
    payload = json.loads(result.stdout)
    assert payload["exit_code"] == result.returncode and set(payload["error"]) == {"type", "message", "retryable"}
    return result.returncode, payload["error"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("a"), build_tiny_model()
    return {name: make_peft_adapter(root / name, base_model=base, r=8, target_modules="all-linear", seed=seed) for name, seed in (("a", 9), ("b", 10), ("c", 11))}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two nodes as a mesh (``--homes 0``, an operator's choice): a Stage stays on its node, so a pull from the other moves
    bytes and the output says so. With placement (the default) two nodes are every id's homes and a Stage reaches both."""
    with LocalCluster(tmp_path_factory.mktemp("cli"), 2, slots=2, extra_args=["--homes", "0"]) as cluster:
        yield [node.address for node in cluster.nodes]


def test_help_version_and_both_console_scripts() -> None:
    import adapter_fabric as package

    helped = fabric("--help").stdout
    for command in ("stage", "pull", "unstage", "ls", "inspect", "locate", "promote", "pin", "unpin", "set-active", "generate", "health", "wait", "rollout", "demo", "make-adapter"):
        assert f"    {command}" in helped, command
    assert "3    retryable" in helped
    assert fabric("--version").stdout.strip() == f"fabric {package.__version__}"
    node_help = subprocess.run([sys.executable, "-m", "adapter_fabric.node.main", "--help"], capture_output=True, text=True, timeout=60)
    assert node_help.returncode == 0 and "[FABRIC_MAX_RANK]" in node_help.stdout and "[FABRIC_EXPORT_DIR]" in node_help.stdout


def test_stage_promote_ls_generate_unstage(nodes, adapters) -> None:
    seed, puller = nodes
    staged = fabric_json("stage", seed, str(adapters["a"]), "--id", "cli/a")
    assert len(staged["digest"]) == 64 and staged["already_staged"] is False and isinstance(staged["content_id"], str)
    again = fabric_json("stage", seed, str(adapters["a"]), "--id", "cli/a")
    assert again["already_staged"] is True and again["digest"] == staged["digest"]

    # content ids: one form, 0x and 16 hex digits, in JSON and in the text alike
    assert re.fullmatch(r"0x[0-9a-f]{16}", staged["content_id"]), staged
    restaged = fabric("stage", seed, str(adapters["a"]), "--id", "cli/a2").stdout  # a new id, the same bytes: said so (was "already staged")
    assert f"content_id={staged['content_id']}" in restaged and "(its bytes were here already: nothing new stored)" in restaged, restaged
    fabric("unstage", seed, "--id", "cli/a2")

    promoted = fabric_json("promote", puller, "--from", seed, "--id", "cli/a", "--name", "a")
    assert promoted["digest"] == staged["digest"] and promoted["slot"] in (0, 1) and promoted["source_peers"] == [seed]

    listing = fabric_json("ls", puller)
    assert [s["adapter_id"] for s in listing["staged"]] == ["cli/a"]
    assert [s["name"] for s in listing["slots"] if s["name"]] == ["a"]
    human = fabric("ls", puller).stdout
    assert "cli/a" in human and "[%d] a" % promoted["slot"] in human and f"id={staged['content_id']}" in human
    # ls counts every file as stored, a promote the weights it moved: each number says which it is, and both are right
    weights = (adapters["a"] / "adapter_model.safetensors").stat().st_size
    stored = weights + (adapters["a"] / "adapter_config.json").stat().st_size  # its two files (not the README PEFT writes)
    assert promoted["bytes_transferred"] == weights
    assert f" {stored} B stored " in human and listing["staged"][0]["size"] == stored > weights, human
    # the slot never filled reads as empty, not as id=0x0000000000000000 ... last_use=0
    assert f"[{1 - promoted['slot']}] (empty)\n" in human and "0x0000000000000000" not in human, human

    generated = fabric_json("generate", puller, "--adapter", "a", "--tokens", "1,2,3", "--max-new-tokens", "4")
    assert len(generated["output_ids"]) == 4 and generated["content_id"] == staged["content_id"]  # u64 ids: strings everywhere

    assert fabric_json("unstage", puller, "--id", "cli/a") == {"adapter_id": "cli/a", "bytes_removed": True}
    assert fabric_json("ls", puller)["staged"] == []


def test_pull_inspect_locate_pin_set_active_health_wait(nodes, adapters, tmp_path) -> None:
    seed, puller = nodes
    made = fabric_json("make-adapter", str(tmp_path / "made"), "--model", "tiny", "--rank", "4")
    assert made["r"] == 4 and (tmp_path / "made" / "adapter_model.safetensors").is_file()
    staged = fabric_json("stage", seed, str(tmp_path / "made"), "--id", "cli/made")

    weights = (tmp_path / "made" / "adapter_model.safetensors").stat().st_size
    pulled = fabric("pull", puller, "--from", seed, "--id", "cli/made").stdout
    assert re.fullmatch(rf"cli/made digest={staged['digest']}: pulled {weights} B of weights from {seed} in [0-9.]+ s\n", pulled), pulled
    again = fabric_json("pull", puller, "--from", seed, "--id", "cli/made")
    assert again["slot"] == -1 and again["digest"] == staged["digest"] and again["bytes_transferred"] == 0 and again["source_peers"] == []
    again = fabric("pull", puller, "--from", seed, "--id", "cli/made").stdout  # a rerun moves nothing, and says so (was "0 bytes")
    assert again == f"cli/made digest={staged['digest']}: already present on the node, nothing moved\n", again
    assert [s["name"] for s in fabric_json("ls", puller)["slots"] if s["name"] == "cli/made"] == []  # stage only: no slot

    manifest = fabric_json("inspect", puller, "--id", "cli/made")
    assert manifest["digest"] == staged["digest"] and manifest["config"]["r"] == 4 and manifest["content_id"] == staged["content_id"]
    assert [f["name"] for f in manifest["files"]] == ["adapter_config.json", "adapter_model.safetensors"]
    located = fabric_json("locate", puller, "--id", "cli/made")
    assert located["peers"] == [{"address": seed, "complete": True, "verified_chunks": 1}]

    fabric("promote", puller, "--id", "cli/made", "--name", "made")
    assert fabric_json("pin", puller, "--name", "made")["pinned"] is True
    assert [s["pinned"] for s in fabric_json("ls", puller)["slots"] if s["name"] == "made"] == [True]
    fabric("unpin", puller, "--name", "made")
    assert fabric_json("set-active", puller, "--name", "made")["content_id"] == staged["content_id"]
    assert fabric_json("health", seed) == {"node": seed, "status": "SERVING"}
    assert fabric_json("wait", seed, puller, "--timeout", "30")["serving"] == [seed, puller]


def test_exit_codes_and_json_errors(nodes) -> None:
    code, error = json_error("promote", nodes[1], "--from", nodes[0], "--id", "missing/one")
    assert code == 1 and error["type"] == "AdapterNotFound" and "missing/one" in error["message"] and error["retryable"] is False
    plain = fabric("promote", nodes[1], "--from", nodes[0], "--id", "missing/one", check=False)
    assert plain.returncode == 1 and plain.stderr.strip().startswith("fabric promote: AdapterNotFound:") and len(plain.stderr.strip().splitlines()) == 1
    # --from names a peer the node knows already: asked once and named once (was "not staged on A, A")
    assert f"not staged on {nodes[0]}:" in plain.stderr and plain.stderr.count(nodes[0]) == 1, plain.stderr

    code, error = json_error("unstage", nodes[0], "--id", "../x")
    assert code == 1 and error["type"] == "InvalidAdapterId"

    code, error = json_error("generate", nodes[0], "--tokens", "1,2,x")
    assert code == 2 and error["type"] == "UsageError" and "'x'" in error["message"]
    bad_tokens = fabric("generate", nodes[0], "--tokens", "1,2,x", check=False)
    assert bad_tokens.returncode == 2 and "'x' in '1,2,x' is not a token id" in bad_tokens.stderr

    code, error = json_error("ls", "127.0.0.1")
    assert code == 2 and "host:port" in error["message"]  # not a silent dial of port 443

    dead = f"127.0.0.1:{free_port()}"
    code, error = json_error("ls", dead)
    assert code == 3 and error["retryable"] is True and dead in error["message"] and "fabric wait" in error["message"]
    code, error = json_error("wait", dead, "--timeout", "1")
    assert code == 3 and dead in error["message"] and "fabric wait" not in error["message"]  # not: run what just timed out


def test_pin_past_the_limit_is_refused_before_anything_is_evicted(nodes, adapters) -> None:
    node = nodes[0]
    for name in ("b", "c"):
        fabric("stage", node, str(adapters[name]), "--id", f"pin/{name}")
    said = fabric("promote", node, "--id", "pin/b", "--name", "pb", "--pin").stdout
    # what was evicted sits by the slot it left (after the peer it read as if the peer had evicted it)
    assert re.fullmatch(r"promoted pin/b as pb into slot \d \((evicted [^,()]+, )?pinned\)\n", said), said
    before = fabric_json("ls", node)["slots"]
    code, error = json_error("promote", node, "--id", "pin/c", "--name", "pc", "--pin")
    # exit 1, not the retryable 3: only an operator's unpin frees a pin, so a script retrying on 3 would loop forever
    assert code == 1 and error["type"] == "PinLimitReached" and error["retryable"] is False and "unpin one first" in error["message"]
    assert "retry" not in error["message"]
    assert fabric_json("ls", node)["slots"] == before  # nothing evicted, nothing loaded, the active adapter unchanged
    fabric("unpin", node, "--name", "pb")


def test_unreachable_tls_nodes_name_the_flag_that_fixes_it(tmp_path) -> None:
    from tests.support.certs import TestCA

    ca = TestCA(tmp_path / "ca")
    with LocalNode(tmp_path / "mtls", model="none", tls=ca.issue("node")) as node:
        code, error = json_error("ls", node.address)  # plaintext to a TLS node
        assert code == 3 and node.address in error["message"] and "--tls-ca" in error["message"]
        code, error = json_error("ls", node.address, "--tls-ca", str(ca.cert_path))  # TLS without a client certificate
        assert code == 3 and "--tls-cert" in error["message"] and "FABRIC_TLS_CERT" in error["message"]
        operator = ca.issue("operator")
        fabric("ls", node.address, "--tls-ca", str(ca.cert_path), "--tls-cert", str(operator.cert), "--tls-key", str(operator.key))


def test_staging_script_matches_the_cli(nodes, adapters) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stage_adapter.py"), nodes[0], str(adapters["a"]), "--id", "script/a", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with NodeClient(nodes[0]) as client:
        assert json.loads(result.stdout)["digest"] == client.manifest("script/a").digest
