"""The background scrub rests as its byte rate asks and works at most a tenth of the time (adapter_fabric.store.scrub_pace).

The pace is driven with a clock of the test's own (no timing: each step of work
and each rest moves it by a known amount), then a real store's scrub is run with a
byte rate it never reaches, to show the rests come from the work, not the bytes.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from adapter_fabric.store import AdapterStore
from adapter_fabric.store.scrub_pace import SCRUB_DUTY, ScrubPace

MIB = 1 << 20


class Clock:
    """Time that moves only when told: by work (``work``) and by the rests the pace asks for (``wait``)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.rests: list[float] = []

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds

    def wait(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds


def test_work_on_small_files_rests_nine_times_as_long_at_the_default_duty() -> None:
    clock = Clock()
    pace = ScrubPace(64 * MIB, clock, clock.wait)
    clock.work(0.5)  # half a second of manifests and headers, a few KB read
    pace(4096)
    assert clock.rests == [pytest.approx(0.5 / SCRUB_DUTY - 0.5)]


def test_the_byte_rate_bounds_large_files_and_the_stricter_bound_wins() -> None:
    clock = Clock()
    pace = ScrubPace(64 * MIB, clock, clock.wait)
    clock.work(0.1)
    pace(128 * MIB)  # two seconds' worth at 64 MiB/s; the duty alone would ask one second
    assert clock.rests == [pytest.approx(2.0 - 0.1)]


def test_over_a_long_scrub_work_stays_within_its_share_and_rests_do_not_count_as_work() -> None:
    clock = Clock()
    started = clock.now
    pace = ScrubPace(64 * MIB, clock, clock.wait)
    generator = random.Random(3)
    worked = 0.0
    for _ in range(5000):
        step = generator.choice((0.0001, 0.001, 0.02))  # a header, a manifest, a slow disk
        clock.work(step)
        worked += step
        pace(generator.choice((2048, 64 << 10, 1 * MIB)))
        assert worked <= SCRUB_DUTY * (clock.now - started) + 1e-9
    assert pace.worked == pytest.approx(worked)


@pytest.mark.parametrize(("rate", "duty"), [(0, 0.1), (-1, 0.1), (MIB, 0.0), (MIB, 1.5)])
def test_a_pace_without_a_rate_or_with_a_duty_outside_its_range_is_refused(rate: int, duty: float) -> None:
    with pytest.raises(ValueError, match="a scrub pace needs"):
        ScrubPace(rate, lambda: 0.0, lambda s: None, duty)


class RecordedStop(threading.Event):
    """The scrub's stop event, recording each rest it is asked for instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.rests: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.rests.append(timeout or 0.0)
        return self.is_set()


def test_a_store_scrub_rests_for_its_work_even_below_its_byte_rate(tmp_path: Path, store_adapters: dict[str, Path]) -> None:
    """A few small adapters at a byte rate of 1 TiB/s: the byte rate asks for no rest; the work does."""
    store = AdapterStore(tmp_path / "s")
    for name in ("a", "b", "c"):
        store.stage(store_adapters[name], f"team/{name}")
    stop = RecordedStop()
    assert store.scrub(1 << 40, stop) == 0
    assert stop.rests and all(rest > 0 for rest in stop.rests)
    assert store.scrub(0) == 0  # unpaced (0): as before, no rest asked
