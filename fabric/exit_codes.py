"""The exit statuses of ``fabric`` and ``fabric-node``: one mapping, so scripts read both alike."""

from __future__ import annotations

from adapter_fabric.errors import FabricError, SlotBusy

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_RETRYABLE = 3
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """exit status:
  0    done
  1    refused: change something first (bad id, not found, incompatible, a pin past the pin limit, ...)
  2    usage error (a bad flag, argument or FABRIC_* variable; fabric-node too)
  3    retryable: pool full, slot busy, store quota, node unreachable; the same command may succeed later
  130  interrupted (Ctrl-C)"""


def exit_code_for(exc: FabricError) -> int:
    """3 for conditions that pass by themselves (``retryable`` errors and a busy slot), else 1."""
    return EXIT_RETRYABLE if exc.retryable or isinstance(exc, SlotBusy) else EXIT_REFUSED
