"""Every duration and size flag of ``fabric`` and ``fabric-node`` takes units through one parser (adapter_fabric.units).

The flags are found by walking the argparse parsers, so a new ``--something-timeout``
or ``--something-bytes`` flag is covered without editing this file.
"""

from __future__ import annotations

import argparse
import re

import pytest

from adapter_fabric.cli.main import build_parser as fabric_parser
from adapter_fabric.cli.main import run
from adapter_fabric.units import MAX_BYTES, format_duration, format_size, parse_duration, parse_size
from adapter_fabric.node.settings import build_parser as node_parser
from adapter_fabric.node.settings import parse_settings

DURATION_FLAG = re.compile(r"--(.*-)?(timeout|after|interval)$")
SIZE_FLAG = re.compile(r"--(.*-)?(bytes|rate|chunk-size)$")
REFUSED = ("-1", "nan", "inf", "-inf", "1e308", "1e3", "abc", "", "99999999999999999999999")


def _flags(parser: argparse.ArgumentParser, where: str = "") -> list[tuple[str, argparse.Action]]:
    """(``command --flag``, action) for every option of ``parser`` and its subcommands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _flags(sub, f"{where}{name} ")
        for flag in action.option_strings:
            if flag.startswith("--"):
                found.append((f"{where}{flag}", action))
    return found


ALL_FLAGS = _flags(fabric_parser(), "fabric ") + _flags(node_parser(), "fabric-node ")
DURATIONS = [(name, action) for name, action in ALL_FLAGS if DURATION_FLAG.search(name)]
SIZES = [(name, action) for name, action in ALL_FLAGS if SIZE_FLAG.search(name)]


def test_the_walk_finds_the_flags_the_readme_names() -> None:
    names = {name for name, _ in DURATIONS + SIZES}
    for expected in ("fabric-node --drain-timeout", "fabric-node --expire-abandoned-after", "fabric-node --max-store-bytes",
                     "fabric-node --max-adapter-bytes", "fabric wait --timeout", "fabric pull --timeout"):
        assert expected in names


@pytest.mark.parametrize(("name", "action"), DURATIONS, ids=[name for name, _ in DURATIONS])
def test_every_duration_flag_takes_units_and_refuses_by_name(name, action) -> None:
    assert action.type("30s") == 30 and action.type("15m") == 900 and action.type("1.5") == 1.5
    try:
        assert action.type("24h") == 86400
    except argparse.ArgumentTypeError as exc:  # a flag with a tighter bound (--sglang-sync-interval: at most 1h) says it
        assert "duration" in str(exc) and "24h" in str(exc), exc
    for bad in REFUSED:
        with pytest.raises(argparse.ArgumentTypeError, match="duration"):
            action.type(bad)


@pytest.mark.parametrize(("name", "action"), SIZES, ids=[name for name, _ in SIZES])
def test_every_size_flag_takes_units_and_refuses_by_name(name, action) -> None:
    assert action.type("64KiB") == 64 << 10 and action.type("1MiB") == 1 << 20 and action.type("8192") == 8192
    for bad in REFUSED:
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(bad)


def test_the_environment_takes_the_same_units(capsys) -> None:
    env = {"FABRIC_DRAIN_TIMEOUT": "30s", "FABRIC_MAX_STORE_BYTES": "18GiB", "FABRIC_MAX_ADAPTER_BYTES": "4GiB",
           "FABRIC_EXPIRE_ABANDONED_AFTER": "24h", "FABRIC_UPLOAD_RATE": "10MB"}
    settings = parse_settings([], env)
    assert (settings.drain_timeout, settings.max_store_bytes, settings.max_adapter_bytes) == (30, 18 << 30, 4 << 30)
    assert (settings.expire_abandoned_after, settings.upload_rate) == (86400, 10_000_000)
    for variable, bad in (("FABRIC_DRAIN_TIMEOUT", "-1"), ("FABRIC_MAX_STORE_BYTES", "nan"), ("FABRIC_STALL_TIMEOUT", "1e308")):
        with pytest.raises(SystemExit) as stopped:
            parse_settings([], {variable: bad})
        assert stopped.value.code == 2 and variable in capsys.readouterr().err  # a usage error, as fabric's


def test_help_prints_defaults_the_way_the_readme_writes_them() -> None:
    shown = " ".join(node_parser().format_help().split())
    for default in ("4 GiB) [FABRIC_MAX_ADAPTER_BYTES]", "24h) [FABRIC_EXPIRE_ABANDONED_AFTER]", "10s) [FABRIC_DRAIN_TIMEOUT]",
                    "64 MiB) [FABRIC_SCRUB_RATE]", "1 MiB) [FABRIC_CHUNK_SIZE]"):
        assert default in shown
    assert "4294967296" not in shown and "86400" not in shown


@pytest.mark.parametrize("bad", ["-1", "nan", "1e308"])
def test_a_bad_cli_timeout_is_a_usage_error(bad, capsys) -> None:
    assert run(["wait", "127.0.0.1:1", "--timeout", bad]) == 2
    assert "--timeout" in capsys.readouterr().err


def test_the_printers_round_trip() -> None:
    for size in (4 << 30, 64 << 20, 4096, 1000, MAX_BYTES):
        assert parse_size(format_size(size).replace(" ", "")) == size
    for seconds in (86400, 600, 10, 2.5):
        assert parse_duration(format_duration(seconds)) == seconds


def test_kubernetes_quantities_and_iec_units_mean_what_they_mean_there() -> None:
    """Ki/Mi/Gi/Ti and KiB/... are powers of 1024; k/K/M/G/T and KB/... powers of 1000 (10G was 10 GiB, 20Gi was refused)."""
    assert parse_size("20Gi") == parse_size("20GiB") == 20 << 30
    assert parse_size("18Gi") == 18 << 30 and parse_size("512Mi") == 512 << 20 and parse_size("1Ki") == 1024 and parse_size("2Ti") == 2 << 40
    assert parse_size("10G") == parse_size("10GB") == 10 * 10**9
    assert parse_size("1k") == parse_size("1K") == parse_size("1KB") == 1000 and parse_size("5M") == 5 * 10**6
    assert parse_size("64kib") == parse_size("64KI") == 64 << 10  # letters in any case
    settings = parse_settings(["--max-store-bytes", "20Gi"], {"FABRIC_MAX_ADAPTER_BYTES": "2Gi", "FABRIC_UPLOAD_RATE": "100M"})
    assert (settings.max_store_bytes, settings.max_adapter_bytes, settings.upload_rate) == (20 << 30, 2 << 30, 100 * 10**6)


def test_help_says_which_size_suffix_is_binary_and_which_decimal() -> None:
    shown = " ".join(node_parser().format_help().split())
    assert "64KiB or 64Ki = 64 x 1024 bytes; 64KB or 64k = 64 x 1000" in shown
    sign_help = " ".join(fabric_parser()._subparsers._group_actions[0].choices["sign"].format_help().split())
    assert "Ki" in sign_help and "1000" in sign_help


def test_choices_take_any_case(capsys) -> None:
    settings = parse_settings(["--log-level", "debug", "--log-format", "JSON", "--when-full", "Refuse"], {"FABRIC_DEVICE": "CPU"})
    assert (settings.log_level, settings.log_format, settings.when_full, settings.device) == ("DEBUG", "json", "refuse", "cpu")
    with pytest.raises(SystemExit):
        parse_settings(["--log-level", "loud"], {})
    assert "expected one of DEBUG, INFO, WARNING, ERROR" in capsys.readouterr().err
