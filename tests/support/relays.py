"""Relay peers (tests/support/peers/) as objects a test drives: start, wait for their news, release, kill."""

from __future__ import annotations

import select
import subprocess
import sys

from tests.support import PEERS


class GatedRelay:
    """peers/gated_peer.py in front of ``upstream``: relays chunk by chunk and holds after ``hold_after`` chunks in all.

    A test points a pull at ``address``, waits for ``wait_holding()`` (the pull is then in progress,
    with exactly ``hold_after`` chunks sent), does what must happen mid-pull, then calls ``go()``,
    or ``kill()`` to cut the pull's stream as a dying peer would.
    """

    def __init__(self, upstream: str, hold_after: int, chunk_size: int = 4096) -> None:
        self.hold_after = hold_after
        self.process = subprocess.Popen(
            [sys.executable, str(PEERS / "gated_peer.py"), upstream, "--hold-after", str(hold_after), "--chunk-size", str(chunk_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.process.stdout.readline()
        if not line.startswith("listening on "):
            self.kill()
            raise RuntimeError(f"the gated relay did not start: {line!r}")
        self.address = line.split()[-1]

    def wait_holding(self, timeout: float = 120.0) -> None:
        """Block until the relay holds; fail naming the cause if it does not within ``timeout`` (the pull never came to it)."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"the gated relay did not hold within {timeout:g}s: was it asked for {self.hold_after + 1} chunks?"
        line = self.process.stdout.readline().strip()
        assert line == f"holding after {self.hold_after} chunks", line

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> "GatedRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class HoldingRelay:
    """peers/holding_peer.py in front of a (durable) node ``upstream``: relays Availability and GetManifest, and holds a
    Promote (a hand-off of a last copy) until ``go()``: a durable peer that accepted the hand-off and hangs."""

    def __init__(self, upstream: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEERS / "holding_peer.py"), upstream], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.process.stdout.readline()
        if not line.startswith("listening on "):
            self.kill()
            raise RuntimeError(f"the holding relay did not start: {line!r}")
        self.address = line.split()[-1]

    def wait_holding(self, timeout: float = 120.0) -> str:
        """The id of the Promote the relay holds, once one arrived; fails naming the cause if none does within ``timeout``."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"the holding relay was sent no Promote within {timeout:g}s"
        line = self.process.stdout.readline().strip()
        assert line.startswith("holding a Promote of "), line
        return line.rsplit(" ", 1)[-1]

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> "HoldingRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
