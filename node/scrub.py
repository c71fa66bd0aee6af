"""The background scrub: every committed blob re-read and verified now and then, and what fails pulled again (``adapter_fabric.node.repair``)."""

from __future__ import annotations

import logging
import threading

from adapter_fabric.errors import IntegrityError
from adapter_fabric.node.repair import DamageReports
from adapter_fabric.store import AdapterStore

log = logging.getLogger("fabric.node")

#: seconds between two scrubs of the whole store (the first runs at start)
SCRUB_INTERVAL_S = 6 * 3600.0


class Scrubber:
    """Re-reads the store at --scrub-rate bytes/s on its own thread (started here when the rate is above 0)."""

    def __init__(self, store: AdapterStore, reports: DamageReports, rate: int) -> None:
        self.store = store
        self.reports = reports
        self._stop = threading.Event()
        if rate > 0:
            threading.Thread(target=self._loop, args=(rate,), name="scrub", daemon=True).start()

    def stop(self) -> None:
        """Ask the scrub to stop (it reads on until its current chunk ends; the thread is a daemon)."""
        self._stop.set()

    def _loop(self, rate: int) -> None:
        """Scrub now, then every SCRUB_INTERVAL_S, at ``rate`` bytes/s; re-pull what fails."""
        while not self._stop.is_set():
            try:
                self.store.scrub(rate, self._stop, self._repair)
            except Exception:  # noqa: BLE001 - a scrub must never take the node down; it runs again later
                log.exception("store scrub failed")
            self._stop.wait(SCRUB_INTERVAL_S)

    def _repair(self, adapter_id: str, digest: str, error: IntegrityError) -> None:
        self.reports.found(adapter_id, digest, error, found_by="the scrub")
