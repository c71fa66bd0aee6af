"""One parser and printer for durations and sizes, shared by every flag and variable.

Durations: ``90``, ``90s``, ``15m``, ``24h``, ``7d`` (a plain number is seconds).
Sizes: ``4096``, ``64KiB``, ``18GiB``, ``20Gi``, ``1.5GB`` (a plain number is bytes). The
suffixes follow Kubernetes quantities and IEC: ``Ki``/``KiB``, ``Mi``/``MiB``, ``Gi``/``GiB``,
``Ti``/``TiB`` are powers of 1024; ``k``/``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``
powers of 1000 (so ``10G`` is 10,000,000,000 bytes, as ``10G`` in a Kubernetes manifest;
letters in any case). Negative, nan, inf and absurd values (past ``MAX_SECONDS`` or
``MAX_BYTES``) are refused with a ValueError that says what is expected, so ``--timeout -1``
or ``--timeout 1e308`` never reaches a deadline computation.
"""

from __future__ import annotations

import re

MAX_SECONDS = 366 * 86400.0  # a year: longer is a typo, not a deadline
MAX_BYTES = 1 << 50  # 1 PiB

_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_DURATION = re.compile(_NUMBER + r"\s*(s|m|h|d)?")
_SIZE = re.compile(_NUMBER + r"\s*(b|kib|mib|gib|tib|ki|mi|gi|ti|kb|mb|gb|tb|k|m|g|t)?")
_SECONDS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_BYTES = {
    None: 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,  # Kubernetes' binary suffixes
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,  # Kubernetes' decimal ones (and SI's)
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
#: what --help says of sizes (fabric-node's epilog, fabric's size flags)
SIZE_UNITS_HELP = "sizes: 64KiB or 64Ki = 64 x 1024 bytes; 64KB or 64k = 64 x 1000 (likewise Mi/MiB, Gi/GiB, Ti/TiB against M/MB, G/GB, T/TB); a plain number is bytes"
#: what fabric-node --help says of every duration and size
UNITS_HELP = f"Durations: 30s, 15m, 24h, 7d (a plain number is seconds); {SIZE_UNITS_HELP}."
_SIZE_NAMES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DURATION_NAMES = (("h", 3600), ("m", 60))  # hours at most: the README writes 24h


def parse_duration(text: str, *, allow_zero: bool = True) -> float:
    """Seconds from ``text``; ValueError naming the accepted forms and bounds otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    seconds = float(match.group(1)) * _SECONDS[match.group(2)] if match else -1.0
    too_small = seconds < 0 or (seconds == 0 and not allow_zero)
    if not match or seconds > MAX_SECONDS or too_small:
        least = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"expected a duration {least}, at most 366d, such as 30, 30s, 15m, 24h or 7d")
    return seconds


def parse_size(text: str, *, allow_zero: bool = True) -> int:
    """Bytes from ``text``; ValueError naming the accepted forms and bounds otherwise."""
    match = _SIZE.fullmatch(text.strip().lower())
    size = int(float(match.group(1)) * _BYTES[match.group(2)]) if match else -1
    if not match or size > MAX_BYTES or size < (0 if allow_zero else 1):
        least = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"expected a size {least}, at most 1 PiB, such as 4096, 64KiB, 4GiB, 20Gi or 10GB (Ki/KiB: 1024, K/KB: 1000)")
    return size


def parse_chunk_size(text: str) -> int:
    """Bytes per verified chunk, 4 KiB to 4 MiB (``fabric-node --chunk-size``, ``fabric sign --chunk-size``)."""
    value = parse_size(text)
    if not 4096 <= value <= 4 << 20:
        raise ValueError("expected 4KiB to 4MiB")
    return value


def format_size(size: int) -> str:
    """``4 GiB`` when ``size`` is a whole number of a binary unit, else ``N B``."""
    for name, unit in _SIZE_NAMES:
        if size and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"


def describe_size(size: int) -> str:
    """A size to read at a glance, in the binary units the flags take: ``812 B``, ``200 KiB``, ``1.5 GiB`` (one decimal at most)."""
    for name, unit in _SIZE_NAMES:
        if size >= unit:
            return f"{size / unit:.1f}".removesuffix(".0") + f" {name}"
    return f"{size} B"


def format_duration(seconds: float) -> str:
    """``24h``, ``15m``, ``10s`` (the largest whole unit), ``2.5s`` otherwise."""
    for name, unit in _DURATION_NAMES:
        if seconds and seconds % unit == 0:
            return f"{int(seconds // unit)}{name}"
    return f"{seconds:g}s"
