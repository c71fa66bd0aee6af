"""One parser for every duration, size, rate and count that ``fabric`` and ``fabric-node`` take.

Flags and environment variables read the same text the README writes:
``30s``, ``15m``, ``24h``, ``7d`` (a plain number is seconds); ``4GiB``,
``64MiB``, ``512KiB``, ``1GB`` (a plain number is bytes); a rate is a size
with an optional ``/s`` (``64MiB/s``). Negative, ``nan``, ``inf`` and absurd
values (past each parser's bound) are refused with a sentence naming what is
expected. ``--help`` shows defaults through ``show_size``/``show_duration``.

Each parser made here carries a ``unit`` attribute ("duration", "size",
"rate", "count") so a test can walk the argparse parsers and find them all.
"""

from __future__ import annotations

import math
import re
from typing import Callable

#: a year: longer than any timeout or expiry anyone means; 1e308 is a typo, not a plan
MAX_SECONDS = 365 * 86400.0
#: 1 PiB: past any disk a node has
MAX_BYTES = 1 << 50
#: counts (tokens, ranks, seeds) above this are typos
MAX_COUNT = (1 << 31) - 1

_NUMBER = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")
_SECONDS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_BYTES = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BINARY = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SPANS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def _split(text: str, expected: str) -> tuple[float, str]:
    """(number, unit) of ``12.5GiB``; a sign, nan, inf or exponent never matches, so all are refused here."""
    match = _NUMBER.fullmatch(text.strip())
    if not match:
        raise ValueError(f"expected {expected}")
    return float(match.group(1)), match.group(2).lower()


def _tag(parse: Callable[[str], object], unit: str, example: str) -> Callable[[str], object]:
    parse.unit = unit  # type: ignore[attr-defined]
    parse.example = example  # type: ignore[attr-defined]
    return parse


def duration_parser(*, zero: str = "", low: float = 0.0, high: float = MAX_SECONDS) -> Callable[[str], float]:
    """Seconds from ``30s``/``15m``/``24h``/``7d``/``250ms``/``90``; ``zero`` names what 0 means (empty: 0 refused)."""
    said = "a duration such as 30s, 15m, 24h or 7d" + (f" (0 = {zero})" if zero else ", more than 0")
    limit = f"{show_duration(high)} at most"

    def parse(text: str) -> float:
        number, unit = _split(text, said)
        if unit not in _SECONDS:
            raise ValueError(f"unknown unit {unit!r}: expected {said}")
        seconds = number * _SECONDS[unit]
        if seconds == 0 and zero:
            return 0.0
        if not (seconds > 0 and seconds >= low):
            raise ValueError(f"expected {said}" + (f", {show_duration(low)} at least" if low else ""))
        if seconds > high:
            raise ValueError(f"{clip(text.strip())} is too long: {limit}")
        return seconds

    return _tag(parse, "duration", "30s")  # type: ignore[return-value]


def size_parser(*, zero: str = "", low: int = 1, high: int = MAX_BYTES, rate: bool = False) -> Callable[[str], int]:
    """Bytes (or bytes/s with ``rate``) from ``4GiB``, ``64MiB``, ``1GB``, ``4096``; ``zero`` names what 0 means."""
    kind = "a rate such as 64MiB/s or 10MB/s" if rate else "a size such as 4GiB, 64MiB or 4096 (bytes)"
    said = kind + (f" (0 = {zero})" if zero else "")
    bounds = f"{show_size(low)} to {show_size(high)}"

    def parse(text: str) -> int:
        body = text.strip()
        if rate and body.lower().endswith("/s"):
            body = body[:-2]
        number, unit = _split(body, said)
        if unit not in _BYTES:
            raise ValueError(f"unknown unit {unit!r}: expected {said}")
        value = number * _BYTES[unit]
        if value == 0 and zero:
            return 0
        if not low <= value <= high:  # inf (400 digits) fails here too
            raise ValueError(f"{clip(text.strip())} is out of range: expected {bounds}" + (f" (0 = {zero})" if zero else ""))
        if value != int(value):
            raise ValueError(f"expected a whole number of bytes: {said}")
        return int(value)

    example = next((text for text, value in (("4GiB", 4 << 30), ("1MiB", 1 << 20)) if low <= value <= high), str(low))
    return _tag(parse, "rate" if rate else "size", example + ("/s" if rate else ""))  # type: ignore[return-value]


def count_parser(*, low: int = 1, high: int = MAX_COUNT, what: str = "") -> Callable[[str], int]:
    """A whole number from ``low`` to ``high`` (no sign, no exponent)."""
    what = what or ("a positive integer" if low >= 1 else "a whole number")

    def parse(text: str) -> int:
        if not text.isascii() or not text.isdigit() or not low <= int(text) <= high:  # strict: " 4" and "+4" are typos too
            raise ValueError(f"expected {what} from {low} to {high}")
        return int(text)

    return _tag(parse, "count", str(max(low, 1)))  # type: ignore[return-value]


def finite_parser(*, low: float, high: float, what: str = "a number") -> Callable[[str], float]:
    """A finite decimal number from ``low`` to ``high`` (nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and low <= number <= high):
            raise ValueError(f"expected {what} from {low:g} to {high:g}")
        return number

    return _tag(parse, "count", str(max(low, 1)))  # type: ignore[return-value]


def show_size(value: int, *, rate: bool = False) -> str:
    """``4294967296`` -> ``4 GiB``; a value that is no whole binary unit stays in bytes."""
    suffix = "/s" if rate else ""
    for name, scale in _BINARY:
        if value >= scale and value % scale == 0:
            return f"{value // scale} {name}{suffix}"
    return f"{value} B{suffix}" if value else "0"


def show_duration(seconds: float) -> str:
    """``86400`` -> ``24h``, ``10`` -> ``10s``; the largest unit the value is whole in (hours up to a day and more)."""
    if seconds and seconds == int(seconds):
        for name, scale in _SPANS:
            if seconds % scale == 0 and (name != "d" or seconds % 86400 == 0 and seconds > 86400):
                return f"{int(seconds // scale)}{name}"
    return f"{seconds:g}s" if seconds else "0"


def argparse_type(parse: Callable[[str], object], name: str = "") -> Callable[[str], object]:
    """``parse`` for argparse: its refusal as the usage error's text (argparse would print only "invalid value")."""
    import argparse

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{clip(text)!r}: {exc}") from None

    convert.__name__ = name or getattr(parse, "__name__", "value")  # argparse names the type in some messages
    convert.unit = getattr(parse, "unit", "")  # type: ignore[attr-defined]
    convert.example = getattr(parse, "example", "")  # type: ignore[attr-defined]
    return convert


def clip(text: str, most: int = 40) -> str:
    """``text`` cut to ``most`` characters for an error message (a 400-digit typo is not echoed whole)."""
    return text if len(text) <= most else text[:most] + "..."
