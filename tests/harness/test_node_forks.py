"""Nodes forked from a pre-imported server are real, separate node processes, as ``python -m`` starts them: their own
pid and files, this process's children, the caller's arguments, environment and directory, and exit codes a
subprocess would give. A bad request or a dead server is answered by name, and the server keeps serving."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess

import pytest

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.harness import fork_server, node_forks
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.harness.fork_server import Launch

pytestmark = pytest.mark.slow


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            inodes.add(target)
    return inodes


def test_a_forked_node_is_a_child_of_this_process_and_serves_and_exits_as_a_subprocess_would(tmp_path) -> None:
    node = LocalNode(tmp_path / "a").start()
    servers = list(node_forks._servers.values())
    other = LocalNode(tmp_path / "b", env={"FABRIC_LOG_LEVEL": "INFO"}).start()
    try:
        assert list(node_forks._servers.values()) == servers  # a node's own variable is read when it runs: one server
        assert isinstance(node.process, node_forks.NodeProcess)
        assert node.pid != other.pid != os.getpid()
        for pid in (node.pid, other.pid):
            with open(f"/proc/{pid}/stat") as stat:
                assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # its parent: waited for here
            with open(f"/proc/{pid}/comm") as comm:
                assert comm.read().strip() == "fabric-node"  # as ps and top name it
        with node.client() as client:
            assert client.health() == "SERVING"
        server = next(reversed(node_forks._servers.values()))  # the one these nodes came from (the last used)
        control = _socket_inodes(server.process.pid)
        assert control and not control & _socket_inodes(node.pid)  # so the server sees its socket's end when we go
        assert node.process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            node.process.wait(0.05)
    finally:
        assert node.stop() == 0  # SIGTERM: drained and exited 0
        other.kill()
    assert any(line.endswith("fabric.node: stopped") for line in node.log_tail().splitlines())  # its last words reached its log
    assert other.process is not None and other.process.returncode == -signal.SIGKILL
    assert node.process is not None and node.process.poll() == 0


def test_the_callers_environment_and_directory_reach_the_node(tmp_path, monkeypatch) -> None:
    LocalNode(tmp_path / "first").start().stop()
    servers = list(node_forks._servers.values())
    monkeypatch.chdir(tmp_path)
    node = LocalNode(tmp_path / "a", env={"FABRIC_METRICS_LISTEN": "127.0.0.1:0"}, extra_args=["--store", "relative-store"])
    node.start()  # the later --store wins: a path relative to the node's working directory
    try:
        assert node.metrics_address  # the variable turned the endpoint on
        assert (tmp_path / "relative-store").is_dir()
        assert list(node_forks._servers.values()) == servers  # one server: each node is given its directory
    finally:
        node.stop()
    refused = LocalNode(tmp_path / "b", env={"FABRIC_METRICS_LISTEN": "127.0.0.1:0"}, extra_args=["--chunk-size", "not-a-size"])
    refused.launch()
    assert refused.process is not None and refused.process.wait(60) == 2  # the node's own refusal, on its own stderr
    assert "--chunk-size" in refused.log_tail()


def test_a_dead_server_is_replaced_and_a_bad_request_is_refused_by_name(tmp_path) -> None:
    LocalNode(tmp_path / "a").start().stop()
    server = next(reversed(node_forks._servers.values()))
    wrong_fds = array.array("i", [1])
    server._control.sendmsg([Launch(argv=[], env={}, cwd="/").to_json()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, wrong_fds)])
    assert "descriptors" in json.loads(server._control.recv(4096))["error"]
    read_end, write_end = os.pipe()
    fds = array.array("i", [write_end, write_end])
    server._control.sendmsg([b'{"argv": "no list", "env": {}, "cwd": "/"}'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    assert "argv must be a list" in json.loads(server._control.recv(4096))["error"]
    os.close(read_end)
    os.close(write_end)
    still = LocalNode(tmp_path / "b").start()  # the same server, still serving
    still.stop()
    assert next(reversed(node_forks._servers.values())) is server
    server.process.kill()
    server.process.wait()
    second = LocalNode(tmp_path / "c").start()  # a new server
    second.stop()
    assert next(reversed(node_forks._servers.values())) is not server


def test_an_environment_an_import_reads_gets_its_own_server_and_the_oldest_goes_past_the_bound(tmp_path, monkeypatch) -> None:
    LocalNode(tmp_path / "n0").start().stop()
    usual = next(reversed(node_forks._servers.values()))
    monkeypatch.setattr(node_forks, "MAX_SERVERS", 1)  # each server pays a node's imports once: keep this test to one more
    LocalNode(tmp_path / "n1", env={"HF_HUB_OFFLINE": "1" if os.environ.get("HF_HUB_OFFLINE") != "1" else "0"}).start().stop()
    assert list(node_forks._servers.values()) != [usual] and len(node_forks._servers) == 1
    assert usual.process.poll() == 0  # closed: it saw its socket's end and exited


def test_the_fork_variable_is_one_or_zero(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(node_forks.FORK_VARIABLE, "yes")
    with pytest.raises(InvalidArgument, match="FABRIC_HARNESS_FORK='yes' must be 1"):
        LocalNode(tmp_path / "a").launch()
    monkeypatch.setenv(node_forks.FORK_VARIABLE, "0")
    plain = LocalNode(tmp_path / "b")
    plain.launch()
    assert isinstance(plain.process, subprocess.Popen)  # python -m: stopped before its imports are done
    plain.kill()
    assert plain.process.returncode == -signal.SIGKILL


def test_an_exit_argument_becomes_the_code_the_interpreter_would_give() -> None:
    assert [fork_server._exit_code(code) for code in (None, 0, 3, 256 + 2, -1)] == [0, 0, 3, 2, 255]
    assert fork_server._exit_code("a message") == 1


def test_an_environment_past_what_one_request_carries_is_refused_by_name_and_the_server_keeps_serving(tmp_path) -> None:
    LocalNode(tmp_path / "a").start().stop()
    server = next(reversed(node_forks._servers.values()))
    huge = LocalNode(tmp_path / "b", env={"FABRIC_PADDING": "x" * fork_server.MAX_REQUEST_BYTES})
    with pytest.raises(node_forks.ForkServerFailed, match="took no request|at most"):  # the socket's limit or the server's
        huge.launch()
    LocalNode(tmp_path / "c").start().stop()  # the same server still forks nodes
    assert next(reversed(node_forks._servers.values())) is server
