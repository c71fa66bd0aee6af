"""A benchmark's numeric flags, each held to its range: a value outside is refused by name before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

#: (flag, its value, lowest, highest, why that range), as a refusal names them
Bound = tuple[str, float, float, float, str]


def refuse_out_of_range(parser: argparse.ArgumentParser, bounds: Iterable[Bound], *, grouped: bool = False) -> None:
    """``parser.error`` (usage and the message on stderr, exit 2) at the first flag whose value is not in its range:
    "FLAG takes LOW to HIGH (why), not VALUE". NaN fails too: no comparison with it holds. ``grouped``: the range's
    numbers with thousands separators (a fleet simulation's are large)."""
    for flag, value, low, high, why in bounds:
        if not low <= value <= high:
            shown = (f"{low:,}", f"{high:,}") if grouped else (low, high)
            parser.error(f"{flag} takes {shown[0]} to {shown[1]} ({why}), not {value}")
