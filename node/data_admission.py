"""Which connections the data channel keeps: counted from accept, bounded per source address and in all, idle ones shed first.

A connection is *idle* from its accept until its hello has been read (its TLS handshake included), and again
between two requests on a kept connection: an honest peer sends its hello at once, so idle connections are
what a flood of silent sockets is made of, and a kept one costs its puller only a new connect when shed. At
a bound, the oldest idle connection (of the same source, at the per-source bound) is shed to make room;
only when none is idle is the new connection refused. Counting starts at accept, not at the end of a TLS
handshake: 2,000 silent TLS connections once held ~400 MB and the node's descriptors, uncounted.

Pure bookkeeping over plain data (``Admission`` holds keys, never sockets); ``node.data_server`` acts on its answers.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Admission", "Admitted"]


@dataclass
class Admitted:
    """What ``admit`` answered: whether the new connection may stay, and the idle ones to shed for it."""

    ok: bool
    shed: list[Hashable] = field(default_factory=list)


class Admission:
    """Open connections by key: their source and whether they are idle, oldest first."""

    def __init__(self, max_connections: int, max_per_source: int) -> None:
        self.max_connections = max_connections
        self.max_per_source = min(max_per_source, max_connections)
        self._open: dict[Hashable, tuple[str, bool]] = {}  # key -> (source, idle); insertion order = accept order
        self._per_source: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, key: Hashable, source: str) -> Admitted:
        """Count ``key`` (just accepted from ``source``) when there is room, shedding idle connections to make it."""
        shed: list[Hashable] = []
        if self._per_source.get(source, 0) >= self.max_per_source:
            victim = self._oldest_idle(source)
            if victim is None:
                return Admitted(False)
            shed.append(victim)
            self.leave(victim)
        if len(self._open) >= self.max_connections:
            victim = self._oldest_idle(None)
            if victim is None:
                return Admitted(False, shed)
            shed.append(victim)
            self.leave(victim)
        self._open[key] = (source, True)
        self._per_source[source] = self._per_source.get(source, 0) + 1
        return Admitted(True, shed)

    def busy(self, key: Hashable) -> None:
        """``key`` sent its hello: no longer idle (never shed)."""
        if key in self._open:
            self._open[key] = (self._open[key][0], False)

    def idle(self, key: Hashable) -> None:
        """``key`` finished a request and waits for its next one: idle again (shed first)."""
        if key in self._open:
            self._open[key] = (self._open[key][0], True)

    def leave(self, key: Hashable) -> None:
        """``key`` closed (or was shed)."""
        entry = self._open.pop(key, None)
        if entry is not None:
            left = self._per_source[entry[0]] - 1
            if left:
                self._per_source[entry[0]] = left
            else:
                del self._per_source[entry[0]]

    def _oldest_idle(self, source: str | None) -> Hashable | None:
        for key, (from_source, idle) in self._open.items():
            if idle and (source is None or from_source == source):
                return key
        return None
