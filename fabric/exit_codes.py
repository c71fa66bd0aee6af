"""The exit statuses of ``fabric`` and ``fabric-node``: one table, one mapping from error types.

====  =====================================================================
0     done (``fabric-node``: stopped cleanly, drained on SIGTERM)
1     refused for good: change something first (bad id, not found, the pin
      limit reached, ``fabric-node``: a flag's file, port or store unusable)
2     usage: a bad flag, argument or environment variable (both commands)
3     retryable: the same command may succeed later (pool full, slot busy,
      a store or stream quota, a node unreachable or too slow)
130   interrupted (Ctrl-C)
====  =====================================================================
"""

from __future__ import annotations

from fabric.errors import FabricError, SlotBusy

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_RETRYABLE = 3
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """exit status:
  0    done
  1    refused: change something first (bad id, not found, incompatible, pin limit reached, ...)
  2    usage error (a bad flag, argument or environment variable)
  3    retryable: pool full, slot busy, quota, node unreachable; the same command may succeed later
  130  interrupted (Ctrl-C)"""


def exit_code_for(exc: FabricError) -> int:
    """3 for conditions that pass by themselves (``retryable`` errors and a busy slot), else 1.

    What only a person's act clears (``PinLimit``: an unpin) is not retryable, so a
    script that retries on 3 never loops on it.
    """
    return EXIT_RETRYABLE if exc.retryable or isinstance(exc, SlotBusy) else EXIT_REFUSED
