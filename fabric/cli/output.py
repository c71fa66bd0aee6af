"""How ``fabric`` reports: results as text or JSON, errors as one line (or a JSON object), and its exit codes.

Exit codes (documented in the README and ``fabric --help``):

====  =====================================================================
0     done
1     refused for good: change something first (bad id, not found, ...)
2     usage: a bad flag or argument
3     retryable: the same command may succeed later (pool full, slot busy,
      quota, a node unreachable or too slow)
130   interrupted (Ctrl-C)
====  =====================================================================
"""

from __future__ import annotations

import json
import sys
from typing import Any

from adapter_fabric.client.results import PromoteResult, json_ready


def emit(as_json: bool, payload: Any, human: str) -> None:
    """Print a result: ``payload`` as JSON (u64 ids as strings) or the human text."""
    if as_json:
        print(json.dumps(json_ready(payload), indent=2, sort_keys=True), flush=True)
    else:
        print(human, flush=True)


def pull_note(reply: PromoteResult) -> str:
    """What a pull (or a promote's pull) moved, in words: bytes of weights, a pull it joined, or nothing.

    A rerun after Ctrl-C finds the node's own pull still going (joined) or done (already present): neither
    moved a byte, and neither reads as "0 bytes".
    """
    if reply.joined:
        return f"joined the node's pull already under way from {reply.source_peer} (that pull moved the bytes)"
    if reply.source_peers:
        return f"pulled {reply.bytes_transferred} B of weights from {reply.source_peer} in {reply.pull_seconds:.2f} s"
    return "already present on the node, nothing moved"


def report_error(command: str, as_json: bool, kind: str, message: str, retryable: bool, code: int) -> int:
    """One line on stderr, or with --json one object on stdout: {"error": {"type", "message", "retryable"}, "exit_code"}."""
    if as_json:
        print(json.dumps({"error": {"type": kind, "message": message, "retryable": retryable}, "exit_code": code}, indent=2), flush=True)
    else:
        print(f"fabric {command}: {kind}: {message}" if kind not in ("Interrupted", "UsageError") else f"fabric {command}: {message}", file=sys.stderr, flush=True)
    return code
