"""``fabric`` on a terminal and in a pipe: progress bars, Ctrl-C, resumed uploads (real node processes)."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import FabricError
from adapter_fabric.harness.cluster import LocalCluster
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.store import blake3_of

pytestmark = pytest.mark.slow  # real node processes (the quick tier leaves them out: -m 'not slow')

FABRIC = [sys.executable, "-m", "adapter_fabric.cli"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("a"), build_tiny_model()
    return {
        "small": make_peft_adapter(root / "small", base_model=base, r=16, target_modules="all-linear", seed=21),
        # ~32 MB: an upload long enough to interrupt (rank 4096 over every linear of the tiny model)
        "big": make_peft_adapter(root / "big", base_model=base, r=4096, target_modules="all-linear", seed=22),
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("term"), 2, slots=2, max_rank=16) as started:
        yield started


@pytest.fixture(scope="module")
def nodes(cluster) -> list[str]:
    return [node.address for node in cluster.nodes]


def on_pty(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``fabric ARGS`` with stdout and stderr on a pseudo-terminal; its exit code and everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a real terminal has a size
    process = subprocess.Popen([*FABRIC, *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return process.wait(timeout=10), b"".join(chunks).decode(errors="replace")


def piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FABRIC, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_progress_on_a_terminal_and_none_in_a_pipe(nodes, adapters) -> None:
    seed, puller = nodes
    code, shown = on_pty("stage", seed, str(adapters["small"]), "--id", "term/small")
    assert code == 0 and "stage term/small" in shown and "100%" in shown and "B/s" in shown and "staged term/small" in shown
    code, shown = on_pty("pull", puller, "--from", seed, "--id", "term/small")
    assert code == 0 and "pull term/small" in shown and "100%" in shown and f"from {seed}" in shown
    code, shown = on_pty("rollout", puller, "--from", seed, "--id", "term/small", "--name", "s")
    assert code == 0 and puller in shown and "100%" in shown and "rolled out term/small on 1 of 1 nodes" in shown

    quiet = piped("stage", seed, str(adapters["small"]), "--id", "term/small2")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("staged term/small2")
    quiet = piped("promote", puller, "--from", seed, "--id", "term/small2", "--name", "s2")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("promoted term/small2")
    quiet = piped("rollout", puller, "--from", seed, "--id", "term/small2", "--stage-only")
    assert quiet.returncode == 0 and quiet.stderr == "" and "rolled out" in quiet.stdout


def test_ctrl_c_during_stage_prints_one_line_and_the_same_command_resumes(cluster, adapters) -> None:
    node, big = cluster.nodes[0], adapters["big"]
    weights = big / "adapter_model.safetensors"
    size, sha = weights.stat().st_size, blake3_of(weights)
    command = [*FABRIC, "stage", node.address, str(big), "--id", "term/big"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    with NodeClient(node.address) as observer:
        deadline = time.monotonic() + 120
        while observer.upload_offset("term/big", sha) == 0 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    # Freeze the node mid-upload, so the rest cannot arrive whatever the scheduler does; then Ctrl-C the command.
    os.kill(node.pid, signal.SIGSTOP)
    try:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    assert process.returncode == 130, out + err
    assert err.strip() == "fabric stage: interrupted; run the same command to resume", err

    for _ in range(10):  # the node may still be closing the cut stream (a retryable refusal, exit 3)
        resumed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
        if resumed.returncode != 3:
            break
        time.sleep(1)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at byte" in resumed.stdout, resumed.stdout
    offset = int(resumed.stdout.split("resumed at byte ")[1].split(")")[0].split(",")[0])
    assert 0 < offset < size


def test_interrupted_library_stage_resumes(nodes, adapters) -> None:
    """NodeClient.stage: a stream cut mid-upload keeps its verified prefix; the next stage sends only the rest."""
    adapter = adapters["small"]
    weights = adapter / "adapter_model.safetensors"
    size, sha = weights.stat().st_size, blake3_of(weights)
    piece = 8 << 10

    with NodeClient(nodes[1]) as client, NodeClient(nodes[1]) as observer:

        def crash_once_the_node_holds_bytes(done: int, total: int) -> None:
            if done >= size // 2:
                for _ in range(200):  # the stream is asynchronous: wait until the node has written some of it
                    if observer.upload_offset("resume/a", sha):
                        raise ConnectionAbortedError("simulated client crash mid-upload")
                    time.sleep(0.05)

        with pytest.raises(FabricError):  # gRPC reports the dead request stream as UNKNOWN
            client.stage(adapter, "resume/a", progress=crash_once_the_node_holds_bytes, piece_size=piece)
        assert "resume/a" not in {a.adapter_id for a in client.list().staged}  # nothing half-committed
        kept = observer.upload_offset("resume/a", sha)
        reply = client.stage(adapter, "resume/a", piece_size=piece)
    assert 0 < kept and reply.resumed_from == kept and reply.bytes_received <= size - kept, "the second upload must resume, not start over"
