"""Who is a member of this node's cluster: the only addresses its peer credential (token, client certificate) goes to.

A node acts on a caller's behalf when it pulls (a Promote names the peer to
pull from), and peers that fetch from it name their own address for the swarm
(``fetch_metadata.holder``). Its peer token would otherwise go wherever a
caller pointed it: a registry never forwards its credentials to a
caller-supplied URL, and neither does a node. A member is:

- an address of ``--peers``, or one ``--peers-dns`` resolves to (re-resolved at
  most every ``REFRESH_S``, so a caller cannot make the node resolve a name per
  call), compared as text (lower-cased), the way the node dials it. The
  resolution runs on a thread of its own, one at a time, outside the lock: a
  question waits for it at most ``RESOLVE_DEADLINE_S`` from its start (a
  resolver that hangs holds up no call past that), then the last answer stands;
- with placement (``--homes``), a member of the fleet's ``MemberView``
  (``adapter_fabric.transport.members``: --peers, --peers-dns and --peers-k8s's
  EndpointSlices, kept current by the node): one notion of member, so every
  home a lookup asks gets the credential, and nothing else does;
- with ``--tls-ca`` and ``--peer-tls-name``, any address: gRPC and the data
  channel verify the server's certificate against the cluster's CA and that
  name before a header is sent, so the credential only reaches a server that
  proves it is a node.

Every other address is dialled with no token and no client certificate
(``PeerChannels``), and a Promote naming one is refused by name before it is
dialled unless the operator allows that anonymous pull (``--non-member-peers``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from adapter_fabric.errors import NotAMember
from adapter_fabric.transport.members import MemberView

__all__ = ["Membership", "REFRESH_S", "RESOLVE_DEADLINE_S"]

#: seconds a ``--peers-dns`` resolution answers membership questions before it is resolved again
REFRESH_S = 5.0
#: seconds from a resolution's start that questions wait for it; past that they take the last answer
RESOLVE_DEADLINE_S = 2.0


class Membership:
    """Whether an address is a member (``admits``), and whether a caller may name a non-member (``check_named``)."""

    def __init__(
        self,
        static: tuple[str, ...] = (),
        resolve: Callable[[], list[str]] | None = None,
        *,
        proven_by_certificate: bool = False,
        anonymous_non_members: bool = False,
        has_credential: bool = True,
        clock: Callable[[], float] = time.monotonic,
        view: MemberView | None = None,
        deadline: float = RESOLVE_DEADLINE_S,
    ) -> None:
        """``resolve``: the addresses discovery yields now (``--peers-dns``); ``proven_by_certificate``: every server must show a
        certificate naming ``--peer-tls-name`` under the cluster's CA; ``anonymous_non_members``: a non-member a caller names is
        dialled with no credential instead of refused; ``has_credential``: the node has a token or client certificate to withhold.
        ``view``: the fleet (placement): its members are the members, read at each question (``resolve`` is then not used).
        ``deadline``: how long questions wait for a resolution under way, from its start."""
        self._static = frozenset(a.lower() for a in static)
        self._view = view
        self._resolve = resolve
        self.proven_by_certificate = proven_by_certificate
        self.anonymous_non_members = anonymous_non_members
        self.has_credential = has_credential
        self._clock = clock
        self.deadline = deadline
        self._resolved: frozenset[str] = frozenset()
        self._resolved_at: float | None = None
        self._resolving: threading.Event | None = None  # set when the resolution under way ends
        self._lock = threading.Lock()

    def admits(self, address: str) -> bool:
        """Whether this node's credential may go to ``address``."""
        if self.proven_by_certificate:
            return True
        key = address.lower()
        if key in self._static:
            return True
        if self._view is not None:
            return key in self._view.fleet()
        return self._resolve is not None and key in self._discovered()

    def _discovered(self) -> frozenset[str]:
        """What --peers-dns resolved to last; a stale answer starts one resolution (outside the lock) and waits for it at
        most ``deadline`` from its start."""
        if self._resolve is None:
            return frozenset()
        with self._lock:
            now = self._clock()
            if self._resolving is None and (self._resolved_at is None or now - self._resolved_at >= REFRESH_S):
                self._resolved_at = now
                self._resolving = threading.Event()
                threading.Thread(target=self._resolve_now, args=(self._resolving,), name="peers-dns", daemon=True).start()
            started = self._resolved_at if self._resolved_at is not None else now
            waiting, left = self._resolving, started + self.deadline - now
        if waiting is not None and left > 0:
            waiting.wait(left)
        with self._lock:
            return self._resolved

    def _resolve_now(self, done: threading.Event) -> None:
        try:
            answer: frozenset[str] | None = frozenset(a.lower() for a in self._resolve()) if self._resolve is not None else None
        except OSError:
            answer = None  # the last answer stands (PeerSource.peers logs a failed resolution itself)
        with self._lock:
            if answer is not None:
                self._resolved = answer
            self._resolving = None
        done.set()

    def check_named(self, address: str) -> None:
        """A peer a caller named: ``NotAMember`` unless it is a member, the node has no credential to withhold, or the
        operator allows anonymous pulls from non-members. Raised before anything is dialled."""
        if not self.has_credential or self.anonymous_non_members or self.admits(address):
            return
        raise NotAMember(
            f"peer {address[:100]!r} is not a member of this node's cluster (--peers, --peers-dns, --peers-k8s): this node sends its "
            f"credentials only to members, so it does not dial it; name a member, add the address to --peers, or start the "
            f"node with --non-member-peers anonymous to pull from such an address without credentials"
        )
