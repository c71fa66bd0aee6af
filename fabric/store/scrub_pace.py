"""How fast the background scrub may go: a byte rate, and a share of the time it may spend working.

The byte rate (``--scrub-rate``) bounds the disk reads. It does not bound the
work per file: at 100,000 small adapters (a few KB each) the scrub's time goes
into opening files, parsing manifests and checking headers, not into reading
bytes, and a byte rate of 64 MiB/s let it run flat out, holding the GIL for
about half of every second for a minute and more after each start and every
6 h. A node's answers then waited on it: a ListAdapters page of 1,000 took
about twice as long while it ran (docs/BENCHMARKS.md, issue 34 goal 1). So a
paced scrub also rests ``(1 - duty) / duty`` times as long as it worked
since it last rested: at the default duty of 0.1, at most a tenth of the
time, whatever its files' sizes. Time spent waiting for the GIL counts as
work, so a busy node slows its scrub further.

Pure: the clock and the wait are given (a test drives it with its own clock).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["SCRUB_DUTY", "ScrubPace"]

#: the share of wall time a paced scrub may spend working
SCRUB_DUTY = 0.1


class ScrubPace:
    """Called after each piece of scrub work with the bytes it read; waits as long as the rate and the duty ask."""

    def __init__(self, rate: int, clock: Callable[[], float], wait: Callable[[float], object], duty: float = SCRUB_DUTY) -> None:
        """``rate``: bytes/s, above 0. ``wait(seconds)``: sleeps (it may return early when the scrub is stopped)."""
        if rate <= 0 or not 0 < duty <= 1:
            raise ValueError(f"a scrub pace needs a rate above 0 and a duty in (0, 1], not {rate} and {duty}")
        self._rate = rate
        self._duty = duty
        self._clock = clock
        self._wait = wait
        self._started = self._resumed = clock()
        self._read = 0
        self._worked = 0.0

    def __call__(self, length: int) -> None:
        now = self._clock()
        self._read += length
        self._worked += now - self._resumed
        elapsed = now - self._started
        ahead = max(self._read / self._rate, self._worked / self._duty) - elapsed
        if ahead > 0:
            self._wait(ahead)
        self._resumed = self._clock()

    @property
    def worked(self) -> float:
        """Seconds of work counted so far (all time outside its waits)."""
        return self._worked
