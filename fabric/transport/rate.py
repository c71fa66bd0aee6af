"""A blocking token bucket for threads (the node's --download-rate).

The upload side runs in the event loop and uses aiolimiter; the puller runs
on plain threads, where aiolimiter cannot be used, hence this small class.
"""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """``rate`` bytes per second shared by every caller, with up to one second of burst."""

    def __init__(self, rate: int) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive bytes/s, got {rate}")
        self.rate = float(rate)
        self._tokens = self.rate
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, amount: int) -> None:
        """Block until ``amount`` bytes may move (a request larger than the burst goes into debt)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= amount
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
