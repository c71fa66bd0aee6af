"""Log lines for people (``text``: message then key=value) or collectors (``json``: one object a line).

``event`` logs one line with structured fields; both formats carry them, so a
grep and a log pipeline see the same facts.

Whatever a caller sent (an id, a peer address) may reach a message, so the text
format escapes control characters (newline, ESC, NUL, backspace, ...): one
record is one line, and no input forges a line, a level or a terminal colour.
The json format gets the same from ``json.dumps``'s escapes.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

_FIELDS = "fabric_fields"


def event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields: Any) -> None:
    """One log line with ``fields`` (None values are left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={_FIELDS: {k: v for k, v in fields.items() if v is not None}})


class StateLog:
    """Logs a thing's state only when it changes (an engine's failure, a task's, a refusal): one line per change of
    state, not one per poll. Keeps at most ``max_keys`` things (past that, a new thing's lines are not kept back)."""

    def __init__(self, logger: logging.Logger, max_keys: int = 1000) -> None:
        self.logger = logger
        self.max_keys = max_keys
        self._last: dict[Hashable, str] = {}
        self._lock = threading.Lock()  # told from the event loop and from I/O threads

    def note(self, key: Hashable, state: str, message: str, level: int = logging.INFO, **fields: Any) -> bool:
        """Log ``message`` when ``key``'s state is not ``state`` already; whether it did."""
        with self._lock:
            if self._last.get(key) == state:
                return False
            if key in self._last or len(self._last) < self.max_keys:
                self._last[key] = state
        event(self.logger, message, level, **fields)
        return True

    def state(self, key: Hashable) -> str | None:
        """The state last logged for ``key`` (None: none)."""
        with self._lock:
            return self._last.get(key)

    def forget(self, key: Hashable) -> None:
        """Drop what is kept of ``key`` (its next state is logged whatever it is)."""
        with self._lock:
            self._last.pop(key, None)

    def prune(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop what is kept of every key ``keep`` answers false for (things gone: room for others)."""
        with self._lock:
            self._last = {k: v for k, v in self._last.items() if keep(k)}


#: C0 controls, DEL, C1 controls and Unicode's line and paragraph separators, each as a visible escape
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))} | {0x2028: "\\u2028", 0x2029: "\\u2029"}


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x1b``, ``\\x00``)."""
    return text.translate(_ESCAPES)


def _text_value(value: Any) -> str:
    text = f"{value:.4f}" if isinstance(value, float) else str(value)
    quote = not text or any(c.isspace() or c in '"=' or ord(c) in _ESCAPES for c in text)
    return json.dumps(text) if quote else text


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...``, one line a record (control characters escaped)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record's line with its message's control characters escaped."""
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        """A traceback keeps its lines, each indented, so none can pass for a record of its own."""
        return "\n".join("  " + escape_controls(line) for line in super().formatException(ei).splitlines())

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, _FIELDS, None)
        return line + "".join(f" {k}={_text_value(v)}" for k, v in fields.items()) if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the event's fields (escaped by ``json.dumps``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, _FIELDS, None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Route every logger (gRPC's Python side included) through one stderr handler in ``fmt``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
