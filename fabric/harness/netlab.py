"""Network namespaces for multi-host tests and benchmarks (root only).

Layout: one ``hub`` namespace holding a bridge; one namespace per node, each
joined to the bridge by a veth pair whose two ends are limited with ``tc tbf``
(upload on the node's end, download on the hub's end); one ``ctl``
namespace on an unlimited link, where the driver runs (so the host's own
network is never touched). Every name starts with ``prefix``; ``down()``
kills what runs inside and removes them all, and is safe to call twice.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

#: a tbf qdisc's counters in ``tc -s qdisc show``
_TBF_SENT = re.compile(r"qdisc tbf .*\n\s*Sent \d+ bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> tuple[bool, str]:
    """(True, "") when this process may create namespaces, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root"
    probe = f"fabric-probe-{os.getpid()}"
    try:
        if _ip("netns", "add", probe, check=False).returncode != 0:
            return False, "ip netns add failed"
        _ip("netns", "del", probe, check=False)
    except FileNotFoundError:
        return False, "no ip command"
    return True, ""


@dataclass
class NetLab:
    prefix: str
    nodes: int
    rate_mbit: float
    subnet: str = "10.203.0"  # /24; node i is .(i + 1), ctl is .250
    mtu: int = 0  # 0: the kernel's default (1500); e.g. 9000 to see what is per packet

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def ctl(self) -> str:
        return f"{self.prefix}-ctl"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def namespaces(self) -> list[str]:
        return [self.hub, self.ctl, *(self.node_ns(i) for i in range(self.nodes))]

    def up(self) -> NetLab:
        self.down()  # leftovers of a run that was killed
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            self._join(self.ctl, "hc", f"{self.subnet}.250", limit=False)
            for i in range(self.nodes):
                self._join(self.node_ns(i), f"h{i}", self.node_ip(i), limit=True)
            if self.mtu:
                _ip("-n", self.hub, "link", "set", "br0", "mtu", str(self.mtu))
        except BaseException:
            self.down()
            raise
        return self

    def _join(self, ns: str, hub_end: str, address: str, limit: bool) -> None:
        _ip("netns", "add", ns)
        _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        if self.mtu:
            _ip("-n", self.hub, "link", "set", hub_end, "mtu", str(self.mtu))
            _ip("-n", ns, "link", "set", "eth0", "mtu", str(self.mtu))
        _ip("-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if limit:
            for where, dev in ((ns, "eth0"), (self.hub, hub_end)):
                subprocess.run(
                    ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "100ms"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip

    def link_counters(self) -> dict[str, int]:
        """The tbf qdiscs' totals over every node's link, both directions: packets sent, dropped, held back (overlimits)."""
        totals = {"qdisc_packets": 0, "qdisc_dropped": 0, "qdisc_overlimits": 0}
        for ns in [self.hub, *(self.node_ns(i) for i in range(self.nodes))]:
            shown = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show"], capture_output=True, text=True, check=False).stdout
            for packets, dropped, overlimits in _TBF_SENT.findall(shown):
                totals["qdisc_packets"] += int(packets)
                totals["qdisc_dropped"] += int(dropped)
                totals["qdisc_overlimits"] += int(overlimits)
        return totals

    def counters(self, pids: Iterable[int]) -> dict[str, int]:
        """``link_counters`` and ``tcp_counters`` of ``pids`` (one process living in each namespace to read), together."""
        return {**self.link_counters(), **tcp_counters(pids)}

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def down(self) -> None:
        """Kill every process inside our namespaces (we started them), then delete the namespaces."""
        existing = set(_ip("netns", "list", check=False).stdout.split())
        for ns in self.namespaces():
            if ns not in existing:
                continue
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)


#: TcpExt counters ``tcp_counters`` adds (``/proc/<pid>/net/netstat``): why segments went twice, and ACKs held back
TCP_EXT = {"TCPLossProbes": "tcp_loss_probes", "TCPDSACKRecv": "tcp_dsack_recv", "DelayedACKs": "tcp_delayed_acks"}


def tcp_counters(pids: Iterable[int]) -> dict[str, int]:
    """TCP segments in, out and retransmitted, tail-loss probes sent, duplicates the peer reported (D-SACK: a
    retransmission that was not needed) and ACKs sent by the delayed-ACK timer, summed over the network namespaces of
    ``pids`` (one process per namespace)."""
    totals = {"tcp_in": 0, "tcp_out": 0, "tcp_retrans": 0, **{name: 0 for name in TCP_EXT.values()}}
    for pid in pids:
        try:
            lines = [line.split() for line in open(f"/proc/{pid}/net/snmp") if line.startswith("Tcp:")]
            ext = [line.split() for line in open(f"/proc/{pid}/net/netstat") if line.startswith("TcpExt:")]
        except OSError:
            continue  # the process is gone: its namespace's counters with it
        fields = dict(zip(lines[0], lines[1], strict=True))
        totals["tcp_in"] += int(fields["InSegs"])
        totals["tcp_out"] += int(fields["OutSegs"])
        totals["tcp_retrans"] += int(fields["RetransSegs"])
        for key, value in zip(ext[0], ext[1], strict=True):
            if key in TCP_EXT:
                totals[TCP_EXT[key]] += int(value)
    return totals
