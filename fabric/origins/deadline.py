"""urllib3's retries and timeouts held to one fetch's deadline.

A fetch has one deadline (``FetchLimits``), but urllib3 gives each attempt the
same timeouts and retries a timed-out read: an origin that accepts and never
answers took ``tries`` whole timeouts (3.4 s for a 1 s deadline), and was then
named unavailable, not slow. Here no retry starts once the deadline has
passed, no backoff sleeps past it, and each attempt's connect and read wait at
most what is left of it.
"""

from __future__ import annotations

import time
from typing import Any

from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

#: the least wait an attempt is given (a socket timeout of 0 would make it non-blocking)
MIN_WAIT_S = 0.001


def _left(deadline: float) -> float:
    return max(MIN_WAIT_S, deadline - time.monotonic())


class DeadlineRetry(Retry):
    """urllib3's ``Retry`` that is exhausted once ``deadline`` (``time.monotonic()``) has passed."""

    def __init__(self, *args: Any, deadline: float = float("inf"), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def new(self, **kw: Any) -> DeadlineRetry:
        kw.setdefault("deadline", self.deadline)
        return super().new(**kw)

    def is_exhausted(self) -> bool:
        return super().is_exhausted() or time.monotonic() >= self.deadline

    def get_backoff_time(self) -> float:
        return min(super().get_backoff_time(), max(0.0, self.deadline - time.monotonic()))


class DeadlineTimeout(Timeout):
    """urllib3's ``Timeout`` whose connect and read waits are each at most what is left before ``deadline``."""

    def __init__(self, deadline: float, connect: float, read: float) -> None:
        super().__init__(connect=connect, read=read)
        self.deadline = deadline
        self.connect_bound, self.read_bound = connect, read

    def clone(self) -> DeadlineTimeout:  # urllib3 clones the timeout for each attempt
        return DeadlineTimeout(self.deadline, self.connect_bound, self.read_bound)

    @property
    def connect_timeout(self) -> float:
        return min(self.connect_bound, _left(self.deadline))

    @property
    def read_timeout(self) -> float:
        return min(self.read_bound, _left(self.deadline))
