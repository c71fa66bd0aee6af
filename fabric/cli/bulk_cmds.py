"""``fabric stage-many NODE DIR...``: publish many adapter directories at once (self-contained; the CLI registers it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adapter_fabric.exit_codes import EXIT_REFUSED

#: failures printed one a line; the rest are counted (the JSON result lists them all)
MAX_SHOWN_FAILURES = 50


def named_items(dirs: list[str], prefix: str) -> list[tuple[Path, str]]:
    """``(directory, id)`` for each directory: ``prefix``, a ``/`` and the directory's name (``team-x`` gives ``team-x/NAME``,
    never ``team-xNAME``; ``team-x/`` the same; no prefix: the name alone)."""
    joined = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    return [(Path(d), joined + Path(d).resolve().name) for d in dirs]


def cmd_stage_many(args: argparse.Namespace) -> None:
    from adapter_fabric.cli.connect import client_for
    from adapter_fabric.cli.output import emit
    from adapter_fabric.client.bulk import DEFAULT_WORKERS

    items = named_items(args.dirs, args.prefix)
    with client_for(args, timeout=args.timeout) as client:
        result = client.stage_many(items, workers=args.workers or DEFAULT_WORKERS)
    failures = [{"adapter_id": f.adapter_id, "dir": f.directory, "error": type(f.error).__name__, "message": str(f.error)} for f in result.failed]
    for failure in failures[:MAX_SHOWN_FAILURES]:
        print(f"failed: {failure['adapter_id']} ({failure['dir']}): {failure['error']}: {failure['message']}", file=sys.stderr)
    if len(failures) > MAX_SHOWN_FAILURES:
        print(f"... and {len(failures) - MAX_SHOWN_FAILURES} more failures", file=sys.stderr)
    summary = f"{len(result.staged)} staged, {len(failures)} failed"
    emit(args.json, {"staged": [r.to_dict() for r in result.staged], "failed": failures}, summary)
    if failures:
        raise SystemExit(EXIT_REFUSED)


def register(command) -> None:
    """Add ``stage-many`` through ``command(name, handler, help)`` (see ``adapter_fabric.cli.main``)."""
    from adapter_fabric.client.bulk import DEFAULT_WORKERS, MAX_WORKERS

    def workers(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
            raise argparse.ArgumentTypeError(f"{text!r}: expected 1 to {MAX_WORKERS}")
        return int(text)

    p = command(
        "stage-many", cmd_stage_many,
        "upload many PEFT adapter directories to a node at once, each its own durable Stage; a failure names its adapter and "
        "leaves the others staged (exit 1 when any failed)", long=True,
    )  # fmt: skip
    p.add_argument("dirs", nargs="+", metavar="DIR", help="directories with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--prefix", default="", help="each adapter's id is this prefix, a /, and its directory's name (team-a gives team-a/DIRNAME)")
    p.add_argument("--workers", type=workers, default=DEFAULT_WORKERS, help=f"concurrent Stage calls (1 to {MAX_WORKERS}; default {DEFAULT_WORKERS})")
