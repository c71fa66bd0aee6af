"""Log lines for people (``text``: message then key=value) or collectors (``json``: one object a line).

``event`` logs one line with structured fields; both formats carry them, so a
grep and a log pipeline see the same facts.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "fabric_fields"


def event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields: Any) -> None:
    """One log line with ``fields`` (None values are left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={_FIELDS: {k: v for k, v in fields.items() if v is not None}})


def _text_value(value: Any) -> str:
    text = f"{value:.4f}" if isinstance(value, float) else str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, _FIELDS, None)
        return line + "".join(f" {k}={_text_value(v)}" for k, v in fields.items()) if fields else line


class JsonFormatter(logging.Formatter):
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
