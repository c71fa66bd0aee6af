"""Every duration, size, rate and count flag of ``fabric`` and ``fabric-node`` goes through ``fabric.units``.

The test walks both argparse parsers (every subcommand), so a flag added
later with ``type=float`` or ``type=int`` fails here, and every flag with a
unit refuses negative, nan, inf and absurd values with a named sentence.
"""

from __future__ import annotations

import argparse
import math

import pytest

from fabric.cli.main import build_parser as fabric_parser
from fabric.units import duration_parser, show_duration, show_size, size_parser
from node.settings import build_parser as node_parser
from node.settings import parse_settings

HOSTILE = ("-1", "-0.5", "nan", "NaN", "inf", "-inf", "1e308", "-4", "", "  ", "4 parsecs", "99999999999999999999999d", "1" * 400)


def _actions(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _actions(sub, f"{prefix} {name}")
        elif action.option_strings or action.type is not None:
            found.append((f"{prefix} {(action.option_strings or [action.dest])[0]}", action))
    return found


ALL = _actions(node_parser(), "fabric-node") + _actions(fabric_parser(), "fabric")
WITH_UNITS = [(name, action) for name, action in ALL if getattr(action.type, "unit", "")]
#: flag names that say they hold a duration, a size or a count: each must have a unit
NUMERIC_WORDS = ("timeout", "bytes", "rate", "size", "after", "tokens", "rank", "slots", "streams", "seed")


def test_the_walk_finds_the_flags_the_issue_names() -> None:
    names = {name for name, _ in WITH_UNITS}
    for expected in ("fabric-node --drain-timeout", "fabric-node --max-store-bytes", "fabric-node --max-adapter-bytes", "fabric-node --upload-rate",
                     "fabric-node --expire-abandoned-after", "fabric promote --timeout", "fabric wait --timeout", "fabric generate --max-new-tokens",
                     "fabric sign --chunk-size", "fabric make-adapter --rank"):
        assert expected in names, f"{expected} has no unit parser"


@pytest.mark.parametrize(("name", "action"), ALL, ids=[name for name, _ in ALL])
def test_no_flag_takes_a_bare_int_or_float(name: str, action: argparse.Action) -> None:
    assert action.type not in (int, float), f"{name}: type={action.type.__name__}; use a fabric.units parser (bounded, named refusals)"
    if any(word in name.split()[-1] for word in NUMERIC_WORDS) and "--tokens" != name.split()[-1]:
        assert getattr(action.type, "unit", ""), f"{name} reads like a number but has no fabric.units parser"


@pytest.mark.parametrize(("name", "action"), WITH_UNITS, ids=[name for name, _ in WITH_UNITS])
def test_every_unit_flag_refuses_hostile_values_by_name(name: str, action: argparse.Action) -> None:
    for text in HOSTILE:
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            action.type(text)
        message = str(refused.value)
        assert "expected" in message or "too long" in message, (name, text, message)
        assert len(message) < 300, (name, message)
    assert action.type(action.type.example) is not None  # the example the help gives is accepted


def test_units_as_the_readme_writes_them() -> None:
    size, rate, wait = size_parser(), size_parser(rate=True, zero="unlimited"), duration_parser(zero="never")
    assert [size(t) for t in ("18GiB", "4GiB", "64MiB", "512KiB", "1GB", "4096", "4 GiB", "1.5GiB")] == [
        18 << 30, 4 << 30, 64 << 20, 512 << 10, 10**9, 4096, 4 << 30, 3 << 29]
    assert [rate(t) for t in ("64MiB/s", "64MiB", "10MB/s", "0")] == [64 << 20, 64 << 20, 10**7, 0]
    assert [wait(t) for t in ("30s", "15m", "24h", "7d", "250ms", "90", "0")] == [30, 900, 86400, 604800, 0.25, 90, 0]
    with pytest.raises(ValueError, match="0 = never|more than 0"):
        duration_parser()("0")
    with pytest.raises(ValueError, match="whole number of bytes"):
        size("1.5")
    assert [show_size(v) for v in (4 << 30, 8 << 20, 1 << 20, 4096, 1000)] == ["4 GiB", "8 MiB", "1 MiB", "4 KiB", "1000 B"]
    assert show_size(64 << 20, rate=True) == "64 MiB/s"
    assert [show_duration(v) for v in (86400, 10, 120, 3600, 7 * 86400, 0.5)] == ["24h", "10s", "2m", "1h", "7d", "0.5s"]
    assert not math.isnan(wait("0"))


def test_node_flags_and_variables_take_units_alike() -> None:
    flags = parse_settings(["--drain-timeout", "30s", "--max-store-bytes", "18GiB", "--max-adapter-bytes", "4GiB", "--upload-rate", "64MiB/s",
                            "--expire-abandoned-after", "24h"], {})
    env = parse_settings([], {"FABRIC_DRAIN_TIMEOUT": "30s", "FABRIC_MAX_STORE_BYTES": "18GiB", "FABRIC_MAX_ADAPTER_BYTES": "4GiB",
                              "FABRIC_UPLOAD_RATE": "64MiB/s", "FABRIC_EXPIRE_ABANDONED_AFTER": "24h"})
    for settings in (flags, env):
        assert (settings.drain_timeout, settings.max_store_bytes, settings.max_adapter_bytes, settings.upload_rate, settings.expire_abandoned_after) == (
            30.0, 18 << 30, 4 << 30, 64 << 20, 86400.0)
    assert parse_settings(["--max-store-bytes", "1048576"], {}).max_store_bytes == 1 << 20  # plain numbers still work
    with pytest.raises(SystemExit, match="FABRIC_DRAIN_TIMEOUT='nan'.*a duration such as"):
        parse_settings([], {"FABRIC_DRAIN_TIMEOUT": "nan"})
    with pytest.raises(SystemExit, match="--drain-timeout.*'-1'"):
        parse_settings(["--drain-timeout", "-1"], {})


def test_help_prints_defaults_as_the_readme_writes_them() -> None:
    shown = " ".join(node_parser().format_help().split())
    for default in ("(default: 4 GiB)", "(default: 8 MiB)", "(default: 24h)", "(default: 10s)", "(default: 64 MiB/s)", "(default: 1 MiB)"):
        assert default in shown, default
    assert "4294967296" not in shown and "86400" not in shown
    promote = " ".join(fabric_parser()._subparsers._group_actions[0].choices["promote"].format_help().split())
    assert "(default: 1h)" in promote and "3600" not in promote
