"""Waiting for a state a test cannot order itself (a background job's end): a bound on waiting, never a timing assertion."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], what: str, timeout: float = 90.0, every: float = 0.1) -> T:
    """``predicate()``'s first truthy result, polled every ``every`` seconds; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)
