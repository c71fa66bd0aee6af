"""The fleet a node belongs to: the members its sources name now, and which of them stopped answering.

Membership comes from what operators already run, never from a gossip of our own: the static ``--peers``, what
``--peers-dns`` resolves to (a headless Service; re-resolved every ``DNS_REFRESH_S``, DNS cannot be watched) and a
Kubernetes Service's EndpointSlices (watched: ``adapter_fabric.transport.endpoint_slices``). The view is their union,
lower-cased and sorted (``placement.Fleet``): every node given the same sources computes the same fleet, and so the
same homes for every adapter. A node that lists only its peers, not itself, is counted under the address it listens on
(``--listen`` with a host), so ``--peers`` naming the others gives every node the same fleet too.

A member that stops answering is marked down for ``DOWN_FOR_S`` (bounded): lookups, pushes and hand-offs skip it
meanwhile, but it stays a member, so a blip moves no home; only its sources take it out (a pod that ends leaves its
Service's endpoints). A source that fails keeps its last answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from adapter_fabric.transport import discovery
from adapter_fabric.transport.placement import Fleet

__all__ = ["DNS_REFRESH_S", "DOWN_FOR_S", "MemberView"]

log = logging.getLogger(__name__)

#: seconds a member that did not answer is skipped before it is asked again
DOWN_FOR_S = 30.0
#: seconds between two resolutions of --peers-dns
DNS_REFRESH_S = 5.0
#: the source name of the node's own listen address when no source names it
SELF = "self"


class MemberView:
    """The members (``fleet``), this node among them (``me``), and the ones marked down. Safe from any thread."""

    def __init__(
        self,
        listen: str,
        static: Iterable[str] = (),
        *,
        down_for: float = DOWN_FOR_S,
        clock: Callable[[], float] = time.monotonic,
        is_self: Callable[[str, str], bool] = discovery.is_self,
    ) -> None:
        """``listen``: HOST:PORT this node listens on (the bound port); a wildcard host is matched against the sources'
        addresses (``discovery.is_self``). ``static``: --peers."""
        self.listen = listen
        self.down_for = down_for
        self._clock = clock
        self._is_self = is_self
        self._lock = threading.Lock()
        self._sources: dict[str, frozenset[str]] = {}
        self._selfness: dict[str, bool] = {}  # address -> whether it is this node (asked once per address)
        self._down: dict[str, float] = {}  # member -> until when it is skipped
        self._fleet = Fleet.of(())
        self._me: str | None = None
        self.version = 0
        self.update("static", static)

    # ------------------------------------------------------------ sources

    def update(self, source: str, addresses: Iterable[str]) -> bool:
        """What ``source`` names now (its whole answer); True when the fleet changed."""
        named = frozenset(a.strip().lower() for a in addresses if a.strip())
        with self._lock:
            if self._sources.get(source) == named:
                return False
            self._sources[source] = named
            return self._rebuild()

    def answered(self, source: str) -> bool:
        """Whether ``source`` has named its members once (an empty answer counts)."""
        with self._lock:
            return source in self._sources

    def _rebuild(self) -> bool:
        named = set().union(*(a for s, a in self._sources.items() if s != SELF))
        for address in named - self._selfness.keys():
            self._selfness[address] = self._is_self(address, self.listen)
        self._selfness = {a: self._selfness[a] for a in named}  # bounded by the members
        me = min((a for a in named if self._selfness[a]), default=None)
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        if me is None and host not in discovery.WILDCARD_HOSTS:
            me = self.listen.lower()
            named.add(me)
        fleet = Fleet.of(named)
        if fleet.members == self._fleet.members and me == self._me:
            return False
        self._fleet, self._me = fleet, me
        self._down = {m: t for m, t in self._down.items() if m in fleet}
        self.version += 1
        log.info("members: %d (this node %s)", len(fleet), me or "not among them")
        return True

    # ------------------------------------------------------------ the view

    def fleet(self) -> Fleet:
        """The members now (an immutable snapshot: hold it for a whole decision)."""
        with self._lock:
            return self._fleet

    @property
    def me(self) -> str | None:
        """The member that is this node (None when no source names it and it listens on a wildcard host)."""
        with self._lock:
            return self._me

    def peers(self) -> list[str]:
        """Every member but this node, in address order (down ones too)."""
        with self._lock:
            return [m for m in self._fleet.members if m != self._me]

    # ------------------------------------------------------------ answering

    def mark_down(self, member: str, why: str = "") -> None:
        """``member`` did not answer: skipped for ``down_for`` seconds (a non-member is ignored)."""
        member = member.lower()
        with self._lock:
            if member not in self._fleet or member == self._me:
                return
            fresh = member not in self._down or self._down[member] <= self._clock()
            self._down[member] = self._clock() + self.down_for
        if fresh:
            log.info("member %s marked down for %gs: %s", member, self.down_for, why[:200] or "it did not answer")

    def mark_up(self, member: str) -> None:
        with self._lock:
            self._down.pop(member.lower(), None)

    def is_down(self, member: str) -> bool:
        with self._lock:
            until = self._down.get(member.lower())
            return until is not None and until > self._clock()

    def down(self) -> set[str]:
        """The members skipped now."""
        with self._lock:
            now = self._clock()
            return {m for m, until in self._down.items() if until > now}

    def live(self, order: Iterable[str]) -> list[str]:
        """``order`` without the members marked down and without this node."""
        down = self.down()
        me = self.me
        return [m for m in order if m not in down and m != me]
