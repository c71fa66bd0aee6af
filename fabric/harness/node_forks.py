"""Node processes forked from a pre-imported server (``fork_server``), so each starts without paying for its imports.

``launch_forked`` returns a ``NodeProcess``: what ``subprocess.Popen`` gives the caller of a node (pid, stdout,
poll, wait, send_signal, terminate, kill, returncode), for a node whose parent is this process. One server per
environment (an import may read it: the Hub client's endpoint; the node's own ``FABRIC_*`` variables are read
when it runs, so they are left out of that comparison),
started on first use, at most ``MAX_SERVERS`` kept. ``FABRIC_HARNESS_FORK=0`` starts every node by ``python -m``.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import IO

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.harness.fork_server import NODE_MODULE, Launch, prctl

FORK_VARIABLE = "FABRIC_HARNESS_FORK"
MAX_SERVERS = 4  # a server holds ~0.5 GB of imports (shared with its nodes until they write); the oldest goes first
READY_TIMEOUT_S = 300.0  # its imports: seconds on an idle machine, minutes on a loaded one
_PR_SET_CHILD_SUBREAPER = 36


class ForkServerFailed(RuntimeError):
    """The fork server could not start a node (it exited, or refused the request); the message says which."""


def forking_enabled() -> bool:
    """Whether nodes are forked (the default) or started by ``python -m`` (``FABRIC_HARNESS_FORK=0``)."""
    value = os.environ.get(FORK_VARIABLE, "1")
    if value not in ("0", "1"):
        raise InvalidArgument(f"{FORK_VARIABLE}={value[:40]!r} must be 1 (fork nodes from a pre-imported server) or 0 (python -m)")
    return value == "1" and _subreaper()


_subreaper_state: bool | None = None


def _subreaper() -> bool:
    """Make this process the parent of orphaned descendants (Linux), so a forked node's exit code comes to us."""
    global _subreaper_state
    if _subreaper_state is None:
        _subreaper_state = prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return _subreaper_state


class NodeProcess:
    """A forked node seen as ``subprocess.Popen`` shows a child (this process became its parent when it was forked)."""

    def __init__(self, pid: int, args: list[str], stdout: IO[bytes]) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = os.pidfd_open(pid)  # readable once the node exits
        self._reaping = threading.Lock()

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._reaped(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._reaping:
            if self.returncode is None:
                ready, _, _ = select.select([self._exited], [], [], timeout)
                if not ready:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                _, status = os.waitpid(self.pid, 0)
                self._reaped(status)
            assert self.returncode is not None
            return self.returncode

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._exited)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # an unreaped node keeps its pid, so this never signals another process
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One ``fork_server`` process, started with the environment its nodes get (each node is given its directory)."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "adapter_fabric.harness.fork_server", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        self._control = ours
        self._lock = threading.Lock()
        self._ready = False

    def fork(self, launch: Launch, stdout: int, stderr: int) -> int:
        """The pid of a new node running ``launch`` with these descriptors as its stdout and stderr."""
        with self._lock:
            if not self._ready:
                self._control.settimeout(READY_TIMEOUT_S)
                self._ready = self._reply() == {"ready": True}
                self._control.settimeout(None)
            fds = array.array("i", [stdout, stderr])
            try:
                self._control.sendmsg([launch.to_json()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            except OSError as exc:
                raise ForkServerFailed(f"the fork server (pid {self.process.pid}) took no request: {exc}") from None
            reply = self._reply()
        if "pid" not in reply:
            raise ForkServerFailed(f"the fork server (pid {self.process.pid}) refused a node: {reply.get('error', reply)}")
        return int(reply["pid"])

    def _reply(self) -> dict:
        try:
            data = self._control.recv(4096)
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "it closed its socket"
        if not data:
            code = self.process.poll()
            raise ForkServerFailed(f"the fork server (pid {self.process.pid}) is gone ({why}; exit code {code}); its stderr is this process's")
        return json.loads(data)

    def close(self) -> None:
        """Its nodes keep running (their parent is this process); the server exits at its socket's end."""
        self._control.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_servers: OrderedDict[tuple[tuple[str, str], ...], ForkServer] = OrderedDict()
_servers_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> ForkServer:
    key = tuple(sorted((name, value) for name, value in env.items() if not _read_at_run_time(name)))
    with _servers_lock:
        server = _servers.pop(key, None)
        if server is None or server.process.poll() is not None:
            server = ForkServer(env)
        _servers[key] = server
        while len(_servers) > MAX_SERVERS:
            _servers.popitem(last=False)[1].close()
        return server


def _read_at_run_time(name: str) -> bool:
    """A variable no import reads, so nodes differing in it share a server: the node's own (``FABRIC_*``, read by
    its main and at call time) and the name of the test pytest is running (it changes with every test)."""
    return name.startswith("FABRIC_") or name == "PYTEST_CURRENT_TEST"


def launch_forked(command: list[str], env: dict[str, str], stderr: int) -> NodeProcess:
    """A node running ``command`` (``python -m adapter_fabric.node.main ARGS``, as the caller would start it) in ``env``
    and this directory, stdout on a pipe to us."""
    prefix = [sys.executable, "-m", NODE_MODULE]
    if command[:3] != prefix:
        raise InvalidArgument(f"a forked node runs {' '.join(prefix)} ARGS, not {' '.join(command[:3])!r}")
    argv = command[3:]
    cwd = os.getcwd()
    launch = Launch(argv=list(argv), env=dict(env), cwd=cwd)
    read_end, write_end = os.pipe()
    try:
        pid = _server_for(launch.env).fork(launch, write_end, stderr)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return NodeProcess(pid, command, os.fdopen(read_end, "rb"))


def close_servers() -> None:
    """Stop every fork server (nodes already forked keep running)."""
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()
