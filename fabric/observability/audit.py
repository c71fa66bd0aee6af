"""The audit trail: one structured line per change, on the ``fabric.audit`` logger so operators can route it apart.

Each line says who (the principal's name), what (the action), which id and
digest, and the outcome; never a token or any other secret (a principal is
named, its token is not). Fields are cut to ``MAX_FIELD_CHARS`` and control
characters are escaped by the log formatters (``adapter_fabric.observability.logs``),
so no caller input makes a line long or forges another.
"""

from __future__ import annotations

import logging

from adapter_fabric.observability.logs import event

AUDIT_LOGGER = "fabric.audit"
#: longest value of one field of an audit line (an id is at most 1024 characters, a problem may be longer)
MAX_FIELD_CHARS = 300

log = logging.getLogger(AUDIT_LOGGER)


def _cut(value: str) -> str | None:
    if not value:
        return None
    return value if len(value) <= MAX_FIELD_CHARS else value[:MAX_FIELD_CHARS] + "..."


def audit(action: str, principal: str, outcome: str, *, adapter_id: str = "", digest: str = "", detail: str = "") -> None:
    """One audit line: ``audit action=stage principal=team-a adapter=team-a/x digest=... outcome=ok``."""
    level = logging.INFO if outcome == "ok" else logging.WARNING
    event(
        log, "audit", level, action=action, principal=_cut(principal), adapter=_cut(adapter_id), digest=_cut(digest), outcome=outcome,
        detail=_cut(detail),
    )
