"""Repairs: an adapter whose bytes at rest failed a check is pulled again from the peers, in the background.

Damage is found by the scrub (``adapter_fabric.node.scrub``) or by any verified read of the
store (a Fetch serving a peer, a promote, a sha256 asked of GetManifest). The
store quarantines the blob and withdraws its export entries at once
(``adapter_fabric.store.integrity``), ``StoreStatus`` lists the id as damaged until the
repair commits, and the repair is a pull of the id from the known peers, with
the trust check of any pull (``adapter_fabric.node.signed``). Each warning names the adapter
and what found the damage.
"""

from __future__ import annotations

import logging
import threading

from adapter_fabric.errors import FabricError
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.discovery import PeerSource

log = logging.getLogger("fabric.node")

#: ids waiting for or under repair at once; damage found past it is left to the next read or scrub that finds it
MAX_PENDING_REPAIRS = 64
#: repairs pulling at once (each is one pull, sharing the download with any promote of the same adapter)
REPAIR_PULLS = 2
#: seconds before a failed repair is tried again (no peer held it yet), doubling up to ``REPAIR_RETRY_MAX_S``
REPAIR_RETRY_S = 5.0
REPAIR_RETRY_MAX_S = 600.0


class DamageReports:
    """Damage found at rest, waiting for its repair: at most one report per id, at most ``MAX_PENDING_REPAIRS`` in all.

    Made before the store, which reports into it (``AdapterStore(on_damage=...)``); ``Repairs`` takes the reports.
    Safe from any thread; ``found`` never blocks (a report past the bound is left to the next read or scrub that finds it).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queued: dict[str, tuple[str, Exception, str]] = {}  # id -> (digest, error, found by), in arrival order
        self._pending: set[str] = set()  # queued or under repair

    def found(self, adapter_id: str, digest: str, error: Exception, found_by: str = "a verified read") -> None:
        """Queue ``adapter_id``'s repair, unless one is queued or running already, or too many are."""
        with self._cond:
            if adapter_id in self._pending or len(self._pending) >= MAX_PENDING_REPAIRS:
                return
            self._pending.add(adapter_id)
            self._queued[adapter_id] = (digest, error, found_by)
            self._cond.notify()

    def take(self, timeout: float) -> tuple[str, str, Exception, str] | None:
        """The oldest report, ``(id, digest, error, found by)``; None when none came within ``timeout`` seconds."""
        with self._cond:
            if not self._queued and not self._cond.wait_for(lambda: bool(self._queued), timeout):
                return None
            adapter_id = next(iter(self._queued))
            digest, error, found_by = self._queued.pop(adapter_id)
            return adapter_id, digest, error, found_by

    def done(self, adapter_id: str) -> None:
        """``adapter_id``'s repair ended (repaired, left alone, or given up at close): it may be reported again."""
        with self._cond:
            self._pending.discard(adapter_id)


class Repairs:
    """Pulls damaged adapters again from the known peers, one repair per id at a time, as ``reports`` name them."""

    def __init__(self, reports: DamageReports, store: AdapterStore, peer_source: PeerSource, signed: SignedAdapters) -> None:
        self.reports = reports
        self.store = store
        self.peer_source = peer_source
        self.signed = signed
        self._pulls = threading.Semaphore(REPAIR_PULLS)
        self._closed = threading.Event()
        # A daemon thread: a repair never holds up the node's exit.
        threading.Thread(target=self._dispatch, name="repairs", daemon=True).start()

    def _dispatch(self) -> None:
        while not self._closed.is_set():
            report = self.reports.take(timeout=1.0)
            if report is None:
                continue
            adapter_id, digest, error, found_by = report
            peers = self.peer_source.peers()
            log.warning(
                "%s found adapter %r (%s) damaged: %s; %s", found_by, adapter_id, digest[:12], error,
                f"pulling it again from {','.join(peers)}" if peers else "no peer to pull it from yet: promote it from a peer or re-stage it",
            )
            threading.Thread(target=self.repair, args=(adapter_id, digest), name="repair", daemon=True).start()

    def repair(self, adapter_id: str, digest: str) -> None:
        """Pull ``adapter_id`` again until it is whole, trying again after a failure (backing off), while it still names
        ``digest`` (an id unstaged or restaged meanwhile is left alone). Blocking."""
        delay = REPAIR_RETRY_S
        try:
            while not self._closed.is_set() and self.store.damaged_at(adapter_id, digest):
                peers = self.peer_source.peers()
                try:
                    if peers:
                        with self._pulls:
                            self.signed.pull(peers, adapter_id)  # the trust check of any pull: a peer may hold other bytes under this id by now
                        log.info("repaired adapter %r (%s) from %s", adapter_id, digest[:12], ",".join(peers))
                        return
                except FabricError as exc:
                    log.warning("could not repair adapter %r (%s): %s; trying again in %gs", adapter_id, digest[:12], exc, delay)
                self._closed.wait(delay)
                delay = min(delay * 2, REPAIR_RETRY_MAX_S)
        finally:
            self.reports.done(adapter_id)

    def close(self) -> None:
        """Stop taking repairs; a pull running now ends on its own (its thread is a daemon)."""
        self._closed.set()
