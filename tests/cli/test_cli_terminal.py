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
from adapter_fabric.errors import AdapterNotFound, FabricError
from adapter_fabric.harness.cluster import LocalCluster, LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.store import blake3_of
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow  # real node processes (the quick tier leaves them out: -m 'not slow')

FABRIC = [sys.executable, "-m", "adapter_fabric.cli"]


def ctrl_c_as_at_a_terminal() -> None:
    """In the child before ``fabric`` starts: SIGINT at its default, as a terminal's shell leaves it. A suite started as a
    background job of a non-interactive shell (``scripts/test &``) inherits SIGINT ignored, and then no Ctrl-C below
    would reach the command (it ran to the end: exit 0, not 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
    """Two nodes as a mesh (``--homes 0``, an operator's choice): a Stage stays on its node, so the pulls below move bytes
    to show progress for (and to interrupt). With placement (the default) a Stage would reach both nodes, its homes."""
    with LocalCluster(tmp_path_factory.mktemp("term"), 2, slots=2, max_rank=16, extra_args=["--homes", "0"]) as started:
        yield started


@pytest.fixture(scope="module")
def nodes(cluster) -> list[str]:
    return [node.address for node in cluster.nodes]


def on_pty(*args: str, timeout: float = 120, sized: bool = True) -> tuple[int, str]:
    """Run ``fabric ARGS`` with stdout and stderr on a pseudo-terminal; its exit code and everything it wrote.

    ``sized``: the terminal reports 40x160 (TIOCSWINSZ), as a real one does; else it reports 0x0 (a pty nobody sized,
    some CI consoles) and COLUMNS/LINES are unset.
    """
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if sized:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env["COLUMNS"] = "120"
    process = subprocess.Popen([*FABRIC, *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env=env)
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


def drawn_lines(shown: str) -> list[str]:
    """What a terminal shows, line by line: each ``\\r`` redraws the line it is on, so only its last drawing counts."""
    return [line.split("\r")[-1] for line in shown.replace("\r\n", "\n").split("\n")]


def bar_lines(shown: str) -> list[str]:
    """Every drawing of a bar (each redraw too): tqdm's ``|`` frame around a filled part."""
    return [d for line in shown.replace("\r\n", "\n").split("\n") for d in line.split("\r") if "%|" in d and "|" in d.split("%|", 1)[1]]


@pytest.mark.parametrize("sized", [True, False], ids=["sized-terminal", "terminal-of-unknown-size"])
def test_the_final_progress_line_is_drawn_once_and_a_bar_is_drawn(cluster, adapters, sized) -> None:
    """The 100% line printed once (it was twice: a refresh at the total, then close); a bar even where the size is unknown."""
    seed, puller = (node.address for node in cluster.nodes)
    adapter_id = f"once/{'sized' if sized else 'unsized'}"
    for args in (("stage", seed, str(adapters["small"]), "--id", adapter_id), ("pull", puller, "--from", seed, "--id", adapter_id)):
        code, shown = on_pty(*args, sized=sized)
        assert code == 0, shown
        drawings = bar_lines(shown)
        assert drawings and "█" in drawings[-1], shown  # a bar (a frame with a filled part), not the bare counters
        finals = [d for d in drawings if "100%" in d]
        assert len(finals) == 1, finals
        assert [line for line in drawn_lines(shown) if "100%" in line] == finals  # and it stays on screen


def test_ctrl_c_during_stage_prints_one_line_and_the_same_command_resumes(cluster, adapters) -> None:
    node, big = cluster.nodes[0], adapters["big"]
    weights = big / "adapter_model.safetensors"
    size, sha = weights.stat().st_size, blake3_of(weights)
    command = [*FABRIC, "stage", node.address, str(big), "--id", "term/big"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=ctrl_c_as_at_a_terminal)
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
    # At least what was seen kept: the node may still write a piece of the cut stream after ``kept`` was read.
    assert 0 < kept <= reply.resumed_from, "the second upload must resume, not start over"
    assert reply.bytes_received <= size - reply.resumed_from, "the second upload sends only the rest"


def arriving(client: NodeClient, digest: str) -> bool:
    """Whether the node holds ``digest`` or has begun pulling it."""
    try:
        client.availability(digest)
    except AdapterNotFound:
        return False
    return True


def staged_with_a_slow_puller(seed: LocalNode, tmp_path: Path, adapter_id: str, adapter_seed: int) -> tuple[str, LocalNode]:
    """A ~1 MB adapter staged on ``seed`` (its digest), and a started node that pulls at 128 KiB/s: its pull waits ~8 s on
    the rate limit, long after the client is gone (a Ctrl-C and a rerun take well under that; was ~2 MB, ~16 s, which
    every run waited out)."""
    name = adapter_id.rsplit("/", 1)[-1]
    adapter = make_peft_adapter(tmp_path / name, base_model=build_tiny_model(), r=128, target_modules="all-linear", seed=adapter_seed)
    with NodeClient(seed.address) as client:
        digest = client.stage(adapter, adapter_id).digest
    return digest, LocalNode(tmp_path / "slow", model="none", peers=[seed.address], extra_args=["--download-rate", "128KiB"]).start()


def test_ctrl_c_of_pull_leaves_the_nodes_pull_running_and_the_rerun_says_what_it_found(cluster, tmp_path) -> None:
    """The rerun joins the node's pull still under way, then finds the adapter present: neither reads as "0 bytes"."""
    seed = cluster.nodes[0]
    digest, slow = staged_with_a_slow_puller(seed, tmp_path, "term/mid", adapter_seed=23)
    try:
        command = [*FABRIC, "pull", slow.address, "--from", seed.address, "--id", "term/mid"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=ctrl_c_as_at_a_terminal)
        with NodeClient(slow.address) as observer:
            wait_for(lambda: arriving(observer, digest) or process.poll() is not None, "the node's pull to begin", timeout=120, every=0.05)
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
            assert process.returncode == 130 and "run the same command to resume" in err, out + err
            assert not observer.availability(digest).complete  # the node's pull still runs

            rerun = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
            assert rerun.returncode == 0, rerun.stderr
            assert f"joined the node's pull already under way from {seed.address}" in rerun.stdout and "0 B" not in rerun.stdout, rerun.stdout
            assert observer.availability(digest).complete
        again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert again.returncode == 0 and again.stdout.strip() == f"term/mid digest={digest}: already present on the node, nothing moved", again.stdout
    finally:
        slow.stop()


class PtyProcess:
    """``fabric ARGS`` on a sized pseudo-terminal, its output read on a thread while the test drives it."""

    def __init__(self, *args: str) -> None:
        import threading

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "COLUMNS": "120"}
        self.process = subprocess.Popen(
            [*FABRIC, *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env=env, preexec_fn=ctrl_c_as_at_a_terminal
        )
        os.close(slave)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
        self._reader.start()

    def _read(self, master: int) -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            self._chunks.append(data)
        os.close(master)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout)
        return code, b"".join(self._chunks).decode(errors="replace")


def test_ctrl_c_on_a_terminal_prints_its_message_on_a_line_of_its_own(cluster, tmp_path) -> None:
    """Issue 33: the Ctrl-C message of a pull landed inside its progress line ("pull x  12%|██ ...fabric pull: interrupted")."""
    seed = cluster.nodes[0]
    digest, slow = staged_with_a_slow_puller(seed, tmp_path, "term/tty", adapter_seed=24)
    try:
        run = PtyProcess("pull", slow.address, "--from", seed.address, "--id", "term/tty")
        with NodeClient(slow.address) as observer:
            wait_for(lambda: arriving(observer, digest) or run.process.poll() is not None, "the node's pull to begin", timeout=120, every=0.05)
            time.sleep(0.5)  # not an assertion: lets the bar be drawn once or twice before the Ctrl-C
            run.process.send_signal(signal.SIGINT)
            code, shown = run.finish()
    finally:
        slow.stop()
    assert code == 130, shown
    lines = drawn_lines(shown)
    message = "fabric pull: interrupted; run the same command to resume"
    assert message in lines, lines  # a line of its own, not the tail of the bar's
    assert any("pull term/tty" in line and "%" in line for line in lines[: lines.index(message)]), lines  # the bar stays above it


def test_a_failed_rollout_node_keeps_its_bar_where_it_stopped_and_its_whole_reason(tmp_path, cluster, adapters) -> None:
    """Issue 33: a node that failed drew a full bar, its reason cut to the bar's width ("FAILED: PeerU")."""
    seed, target = (node.address for node in cluster.nodes)
    with NodeClient(seed) as client:
        client.stage(adapters["small"], "term/rollout-fail")
    with LocalNode(tmp_path / "store-only", model="none") as store_only:  # refuses a promote into a slot: it has none
        code, shown = on_pty("rollout", target, store_only.address, "--from", seed, "--id", "term/rollout-fail")
    assert code == 1, shown
    lines = drawn_lines(shown)
    bar = [line for line in lines if line.startswith(f"{store_only.address:<21}")]
    assert bar and "FAILED (why: below)" in bar[-1] and "100%" not in bar[-1], lines
    reason = next(line for line in lines if line.strip().startswith(store_only.address) and "FAILED: AdaptersUnsupported:" in line)
    assert "this node is store-only (started with --model none)" in reason and reason.rstrip().endswith("use a node with a model"), reason
