"""Progress on a terminal (tqdm on stderr), nothing when piped or with --json.

A pull runs on the node, so its bar is fed by polling the node: the chunks of
the adapter's digest it holds verified (``Availability``), while the Promote
call itself runs on a worker thread. The main thread only waits and polls, so
Ctrl-C reaches it at once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from tqdm import tqdm

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import FabricError

T = TypeVar("T")
POLL_S = 0.25


def on_terminal(quiet: bool) -> bool:
    """Whether bars are drawn: stderr is a terminal and the output is not JSON."""
    return not quiet and sys.stderr.isatty()


#: the size taken for a terminal that reports none (a pty nobody sized, some CI consoles) when COLUMNS/LINES are unset
FALLBACK_SIZE = (80, 24)


class _Bar(tqdm):
    """A tqdm bar whose full (100%) line is drawn once, by ``close``: a refresh at the total would draw it twice."""

    def refresh(self, nolock: bool = False, lock_args=None):  # noqa: D102 (tqdm's)
        if self.total and self.n >= self.total:
            return False
        return super().refresh(nolock, lock_args)


def end_bars() -> None:
    """Close every bar still drawn (a Ctrl-C came mid-transfer), leaving each where it stopped, so what is printed next
    starts on a line of its own instead of inside the last bar."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def unknown_terminal_size() -> tuple[int, int] | None:
    """None when stderr's terminal reports its size (tqdm then follows it); else the ``(columns, lines)`` to draw in.

    A terminal of size 0x0 would make tqdm draw nothing at all (it fits the bar into 0 columns and -1 rows).
    """
    import os
    import shutil

    try:
        if os.get_terminal_size(sys.stderr.fileno()).columns > 0:
            return None
    except (OSError, ValueError):
        pass
    columns, lines = shutil.get_terminal_size(FALLBACK_SIZE)  # COLUMNS and LINES first
    return columns or FALLBACK_SIZE[0], lines or FALLBACK_SIZE[1]


def byte_bar(desc: str, total: int, enabled: bool, position: int | None = None) -> tqdm:
    """A bytes bar (size, rate, ETA) on stderr; a disabled no-op when ``enabled`` is False."""
    columns, lines = (unknown_terminal_size() if enabled else None) or (None, None)
    return _Bar(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, file=sys.stderr, position=position, leave=True,
        dynamic_ncols=columns is None, ncols=columns, nrows=lines,
    )


def weights_size(client: NodeClient, adapter_id: str) -> tuple[str, int, int] | None:
    """``(digest, weights size, chunk size)`` of an adapter as ``client``'s node holds it; None when it cannot say."""
    try:
        manifest = client.manifest(adapter_id)
    except FabricError:
        return None
    return manifest.digest, manifest.weights.size, manifest.weights.chunk_size


def held_bytes(client: NodeClient, digest: str, size: int, chunk_size: int) -> int:
    """Bytes of ``digest``'s weights the node holds verified (0 while it has none)."""
    try:
        held = client.availability(digest)
    except FabricError:
        return 0
    return size if held.complete else min(size, held.verified_chunks * chunk_size)


def run_polled(call: Callable[[], T], poll: Callable[[], None] | None) -> T:
    """Run ``call`` on a daemon thread; meanwhile run ``poll`` every POLL_S seconds (None: just wait).

    A daemon thread, not an executor: on Ctrl-C the process must exit at once, not join a call still in flight.
    """
    outcome: list = []
    done = threading.Event()

    def worker() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the main thread as is
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=worker, name="fabric-call", daemon=True).start()
    while not done.wait(POLL_S):
        if poll is not None:
            poll()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class PullWatcher:
    """Feeds a bytes bar for one node pulling one adapter, by polling that node's Availability."""

    def __init__(self, node: NodeClient, source: NodeClient | None, adapter_id: str, desc: str, enabled: bool, position: int | None = None) -> None:
        self.node = node
        self.enabled = enabled
        self.plan = weights_size(source, adapter_id) if enabled and source is not None else None
        self.bar = byte_bar(desc, self.plan[1] if self.plan else 0, enabled and self.plan is not None, position)

    def poll(self) -> None:
        """Move the bar to the bytes the node holds now."""
        if self.plan is None:
            return
        digest, size, chunk = self.plan
        self.bar.n = held_bytes(self.node, digest, size, chunk)
        self.bar.refresh()

    def finish(self, note: str, ok: bool = True) -> None:
        """Fill the bar and leave ``note`` (e.g. the sources) after it; a failed pull's bar stays where it stopped."""
        if self.plan is not None:
            if ok:
                self.bar.n = self.plan[1]
            self.bar.set_postfix_str(note, refresh=False)  # close draws the final line, once
        self.bar.close()
