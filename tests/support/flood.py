"""A flood of idle connections: ``count`` TCP connections from ``source`` that send nothing, each one the node closes
opened again (at most ``reopen_per_s`` a second, so the flood itself leaves the test's cores to the nodes)."""

from __future__ import annotations

import selectors
import socket
import threading
import time


class Flood:
    """Holds up to ``count`` silent connections to ``host:port`` from ``source`` (another loopback address) in a thread."""

    def __init__(self, port: int, count: int, *, host: str = "127.0.0.1", source: str = "127.0.0.2", reopen_per_s: float = 200.0) -> None:
        self.address = (host, port)
        self.count = count
        self.source = source
        self.reopen_per_s = reopen_per_s
        self.opened = 0  # connections opened in all
        self.closed_by_node = 0  # of them, closed by the node (cut, shed or refused)
        self.held = 0  # open now
        self._stop = threading.Event()
        self._full = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> "Flood":
        self._thread.start()
        self._full.wait(60)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        budget, last = 0.0, time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                budget = min(self.reopen_per_s, budget + (now - last) * self.reopen_per_s) if self.opened >= self.count else float(self.count)
                last = now
                while self.held < self.count and budget >= 1:
                    budget -= 1
                    try:
                        sock = socket.create_connection(self.address, timeout=2, source_address=(self.source, 0))
                    except OSError:
                        break  # the node's backlog is full: try again in the next round
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ)
                    self.opened += 1
                    self.held += 1
                if self.held >= self.count or self.opened >= self.count:
                    self._full.set()
                for key, _ in selector.select(0.05):
                    sock = key.fileobj
                    try:
                        data = sock.recv(1 << 16)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:  # the node closed it
                        selector.unregister(sock)
                        sock.close()
                        self.held -= 1
                        self.closed_by_node += 1
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()
