"""Real node processes on this machine: used by the demo, the integration tests and the benchmarks.

Each node is a separate ``fabric-node`` process listening on a free loopback
port; it announces the port on its first stdout line. Nodes stop with SIGTERM
(graceful) or SIGKILL (to test crash safety). They are forked from a process
that has done a node's imports already (``node_forks``), unless they run in a
network namespace or ``FABRIC_HARNESS_FORK=0``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.harness.node_forks import NodeProcess, forking_enabled, launch_forked
from adapter_fabric.harness.port_claims import PortClaims
from adapter_fabric.rpc.security import TlsFiles, read_token

_LISTENING = re.compile(r"fabric-node listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on (\S+):(\d+)\)")
START_TIMEOUT_S = 120.0


class LocalNode:
    def __init__(
        self,
        store: Path,
        *,
        model: str = "tiny",
        slots: int = 2,
        max_rank: int = 16,
        peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        tls: TlsFiles | None = None,
        token_file: Path | None = None,
    ) -> None:
        """``tls`` and ``token_file`` turn on the node's --tls-* and --auth-token-file flags; ``client()`` then uses them too."""
        self.store = Path(store)
        self.tls = tls
        self.token_file = token_file
        security_args: list[str] = []
        if tls is not None:
            for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)):
                if path is not None:
                    security_args += [flag, str(path)]
        if token_file is not None:
            security_args += ["--auth-token-file", str(token_file)]
        self.args = [
            "--listen", f"{host}:{port}", "--store", str(self.store), "--model", model,
            "--slots", str(slots), "--max-rank", str(max_rank), "--device", "cpu",
            "--peers", ",".join(peers), *security_args, *extra_args,
        ]  # fmt: skip
        self.log_path = log_path or self.store.with_name(self.store.name + ".log")
        self.env = env
        self.netns = netns
        self.process: subprocess.Popen[bytes] | NodeProcess | None = None
        self.address = ""
        self.metrics_address = ""  # HOST:PORT of /metrics, /healthz, /readyz when started with --metrics-listen
        self.banner = ""  # the node's "fabric-node listening on ..." line
        self._lines: list[str] = []

    def start(self) -> LocalNode:
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (a cluster launches all, then waits)."""
        command = [sys.executable, "-m", "adapter_fabric.node.main", *self.args]
        if self.netns:
            command = ["ip", "netns", "exec", self.netns, *command]
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        self.store.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        if self.netns is None and forking_enabled():  # the usual case: no imports to pay (``node_forks``)
            self.process = launch_forked(command, env, stderr=self._log.fileno())
        else:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, env=env)

    def wait_ready(self) -> LocalNode:
        """Read the announced port, then wait for health SERVING."""
        deadline = time.monotonic() + START_TIMEOUT_S
        process = self.process
        assert process is not None and process.stdout is not None, "start() first"
        while time.monotonic() < deadline:
            line = process.stdout.readline().decode(errors="replace")
            if not line:
                code = process.wait()
                raise PeerUnavailable(f"node exited with code {code} before listening; see {self.log_path}; it ends: {self.log_tail()!r}")
            self._log.write(line.encode())
            match = _LISTENING.search(line)
            if match:
                self.banner = line.strip()
                self.address = f"{match.group(1)}:{match.group(2)}"
                metrics = _METRICS.search(line)
                self.metrics_address = f"{metrics.group(1)}:{metrics.group(2)}" if metrics else ""
                break
        else:
            self.kill()
            raise PeerUnavailable(f"node did not start within {START_TIMEOUT_S:.0f}s; see {self.log_path}")
        # Keep draining stdout so the node never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        self.wait_serving()
        return self

    def log_tail(self, limit: int = 1200) -> str:
        """The last ``limit`` bytes of the node's log: a failure's message carries them, since CI keeps no files."""
        self._log.flush()
        with open(self.log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - limit))
            return log.read().decode(errors="replace")

    def _drain(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._log.write(line)
            self._log.flush()

    def client(self, **kwargs) -> NodeClient:
        """A client of this node with its own certificate and token (a node's cert is also a client cert)."""
        token = read_token(self.token_file) if self.token_file is not None else None
        return NodeClient(self.address, **{"tls": self.tls, "token": token, **kwargs})

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Wait for health SERVING (health is open to any caller, but over TLS the channel must speak TLS)."""
        with NodeClient(self.address, tls=self.tls) as client:
            client.wait_serving(timeout)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: the graceful path."""
        if self.process is None:
            return 0
        code = self.process.poll()
        if code is not None:
            return code
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def terminate(self) -> None:
        """SIGTERM without waiting (``stop`` waits): a cluster tells all its nodes first, so their drains overlap."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the crash path."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_RESERVED_FLOOR = 20000  # ports below this are left to services; free_port draws from here up to the ephemeral range
_claims = PortClaims()
_ephemeral_floor: int | None = None
_next_port: int | None = None


def _ephemeral_range_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (a cluster needs its addresses before its nodes start, to list peers).

    Drawn below the kernel's ephemeral range: a port the kernel hands out itself (a node's data channel on
    port 0, any outgoing connection) can then never take it between this probe and the node's bind. Each
    process walks from its own random start, and claims what it draws against other processes
    (``adapter_fabric.harness.port_claims``), so parallel test workers never draw the same port.
    """
    global _ephemeral_floor, _next_port
    if _ephemeral_floor is None:
        _ephemeral_floor = _ephemeral_range_floor()
    span = _ephemeral_floor - _RESERVED_FLOOR
    if span < 1000:  # an unusual range: take the kernel's pick
        return _probe(host, 0)
    if _next_port is None:
        _next_port = random.Random(os.getpid() ^ time.monotonic_ns()).randrange(span)
    for _ in range(span):
        candidate = _RESERVED_FLOOR + _next_port % span
        _next_port += 1
        try:
            port = _probe(host, candidate)
        except OSError:
            continue
        if _claims.claim(port):  # no other live process drew it (``port_claims``)
            return port
    return _probe(host, 0)


def _probe(host: str, port: int) -> int:
    with socket.socket() as probe:
        probe.bind((host, port))
        return probe.getsockname()[1]


@contextmanager
def running(nodes: list[LocalNode]) -> Iterator[list[LocalNode]]:
    """``start_all``, then ``stop_all`` however the body ends: a fixture's fleet is ``with running(nodes): yield nodes``."""
    start_all(nodes)
    try:
        yield nodes
    finally:
        stop_all(nodes)


def start_all(nodes: list[LocalNode]) -> list[LocalNode]:
    """Launch every node before waiting on any (their start-ups overlap); on any failure every node is stopped."""
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def stop_all(nodes: list[LocalNode]) -> None:
    """All drain at once (each lingers for its peers' streams), then each is waited for."""
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.stop()


class LocalCluster:
    """Several nodes in separate processes, each knowing the others as peers."""

    def __init__(self, root: Path, count: int, host: str = "127.0.0.1", **node_kwargs) -> None:
        self.root = Path(root)
        ports = [free_port(host) for _ in range(count)]
        addresses = [f"{host}:{port}" for port in ports]
        self.nodes = [
            LocalNode(self.root / f"node{i + 1}", host=host, port=port, peers=[a for a in addresses if a != addresses[i]], **node_kwargs)
            for i, port in enumerate(ports)
        ]

    def start(self) -> LocalCluster:
        start_all(self.nodes)
        return self

    def stop(self) -> None:
        stop_all(self.nodes)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
