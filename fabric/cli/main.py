"""``fabric``: the command line of adapter-fabric.

Every command takes ``--json`` (errors included: an object with the error's
type, message and whether it is retryable; 64-bit ids as strings). Node
commands take ``--tls-ca/--tls-cert/--tls-key/--auth-token-file`` (or
``FABRIC_TLS_CA``, ... ``FABRIC_AUTH_TOKEN_FILE``); the ones that move
adapters take ``--timeout``. Exit codes are in ``adapter_fabric.cli.output``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import adapter_fabric as fabric
from adapter_fabric.cli import bulk_cmds, cluster_cmds, local_cmds, sign, slot_cmds, store_cmds, store_status
from adapter_fabric.cli.connect import add_security_flags, duration_arg, node_address
from adapter_fabric.cli.output import report_error
from adapter_fabric.cli.paths import os_problem
from adapter_fabric.errors import FabricError
from adapter_fabric.exit_codes import EXIT_CODES_HELP, EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, exit_code_for

#: commands whose work survives an interruption (the node keeps what it verified): run them again to resume
RESUMABLE = frozenset({"stage", "promote", "pull", "rollout"})
#: default --timeout of commands that move adapters: pulls of GBs over slow links take many minutes
LONG_TIMEOUT_S = 3600.0


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors honour --json (the choice is read from argv before parsing)."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            raise SystemExit(report_error(self.prog, True, "UsageError", message, False, EXIT_USAGE))
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fabric",
        description="Move LoRA adapters between adapter-fabric nodes and serve them.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fabric {fabric.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], None], help: str, node: bool = True, long: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        if node:
            p.add_argument("node", metavar="NODE", type=node_address, help="the node's host:port")
        p.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object on stdout")
        if long:
            p.add_argument("--timeout", type=duration_arg, default=LONG_TIMEOUT_S, help="how long the call may take: 30s, 15m, 1h (plain numbers are seconds); 0 = no limit (default: 1h)")
        if node:
            add_security_flags(p)
        p.set_defaults(handler=handler)
        return p

    for module in (store_cmds, bulk_cmds, slot_cmds, cluster_cmds, local_cmds, sign, store_status):
        module.register(command)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Parse and run one command; the exit status (errors are reported, never raised)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command = args.command
    try:
        args.handler(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_REFUSED
    except FabricError as exc:
        return report_error(command, args.json, type(exc).__name__, str(exc), exit_code_for(exc) != EXIT_REFUSED, exit_code_for(exc))
    except KeyboardInterrupt:
        if "tqdm" in sys.modules:  # a command that draws bars: end them first, the message goes on a line of its own
            from adapter_fabric.cli.progress import end_bars

            end_bars()
        message = "interrupted; run the same command to resume" if command in RESUMABLE else "interrupted"
        return report_error(command, args.json, "Interrupted", message, command in RESUMABLE, EXIT_INTERRUPTED)
    except BrokenPipeError:  # `fabric ls ... | head`
        return EXIT_OK
    except OSError as exc:  # a file named on the command line that a command did not check itself: said in words all the same
        message = f"{os_problem(exc)}: check the paths given on the command line"
        return report_error(command, args.json, "InvalidArgument", message, False, EXIT_REFUSED)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point: run, then exit with its status."""
    code = run(argv)
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
