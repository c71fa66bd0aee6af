"""The log formats (``adapter_fabric.observability.logs``) and the audit trail: one record is one line, whatever a caller sent."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from adapter_fabric.observability.audit import AUDIT_LOGGER, MAX_FIELD_CHARS, audit
from adapter_fabric.observability.logs import JsonFormatter, TextFormatter, escape_controls, event

HOSTILE = "team-a/x\nWARNING fabric.node: forged\x1b[31m\x00\u2028end"


def record(message: str, **fields) -> logging.LogRecord:
    """The record ``event`` would hand a handler (caught from a logger of its own)."""
    caught: list[logging.LogRecord] = []
    logger = logging.getLogger("tests.observability")
    handler = logging.Handler()
    handler.emit = caught.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        event(logger, message, **fields)
    finally:
        logger.removeHandler(handler)
    return caught[0]


def test_every_control_character_is_escaped_and_text_is_kept() -> None:
    assert escape_controls("a\nb\rc\x1bd\x00e\x7ff\u2028g") == "a\\nb\\rc\\x1bd\\x00e\\x7ff\\u2028g"
    assert escape_controls("team-a/støtte ✓") == "team-a/støtte ✓"


def test_a_text_record_is_one_line_with_its_fields_quoted_when_they_need_it() -> None:
    line = TextFormatter().format(record(f"pull {HOSTILE} failed", adapter=HOSTILE, bytes=12, rate=0.5, peer=None))
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert f"pull {escape_controls(HOSTILE)} failed" in line  # the message: each control as its escape
    assert line.endswith(f" adapter={json.dumps(HOSTILE)} bytes=12 rate=0.5000")  # a field that needs it: quoted as JSON
    assert "peer=" not in line  # None fields are left out


def test_a_traceback_keeps_its_lines_each_indented_so_none_passes_for_a_record() -> None:
    try:
        raise ValueError("bad\nINFO fabric.node: forged")
    except ValueError:
        info = sys.exc_info()
    text = TextFormatter().formatException(info)
    assert all(line.startswith("  ") for line in text.splitlines())
    assert text.splitlines()[-1] == "  INFO fabric.node: forged"  # a forged line inside a message stays indented


def test_a_json_record_is_one_object_on_one_line_with_the_fields() -> None:
    line = JsonFormatter().format(record("evicted", adapter=HOSTILE, bytes=3))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "evicted" and entry["adapter"] == HOSTILE and entry["bytes"] == 3 and entry["level"] == "INFO"


def test_an_audit_line_cuts_long_fields_and_warns_on_refusals(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
        audit("stage", "team-a", "ok", adapter_id="x" * 5000)
        audit("fetch", "mallory", "refused", adapter_id="team-a/secret")
    ok, refused = caplog.records
    fields = ok.fabric_fields  # type: ignore[attr-defined]
    assert len(fields["adapter"]) == MAX_FIELD_CHARS + 3 and fields["adapter"].endswith("...")
    assert ok.levelno == logging.INFO and refused.levelno == logging.WARNING
    assert "digest" not in fields  # empty fields are left out
