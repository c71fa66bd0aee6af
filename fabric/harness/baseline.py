"""A benchmark's baseline: the package of another git revision, imported by a node process in place of this tree's.

``baseline_env(repo, rev, into)`` exports ``fabric/`` and ``node/`` of ``rev`` (``git archive``) under ``into`` and lays
them out as the install does (``adapter_fabric`` holding fabric/'s entries and ``node``); the environment it returns puts
that first on ``PYTHONPATH``, ahead of the editable install's import hook. A benchmark then starts the baseline's node and
this tree's side by side, in one run, on the same machine (``scripts/bench_listing.py``, ``scripts/bench_stage.py``).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path


def baseline_env(repo: Path, rev: str, into: Path) -> dict[str, str]:
    """The environment that makes a node import the package of git revision ``rev`` of ``repo`` (exported under ``into``)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "fabric", "node"], check=True, capture_output=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)
    package = into / "path" / "adapter_fabric"
    package.mkdir(parents=True)
    for entry in (into / "fabric").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "node").symlink_to(into / "node")
    return {"PYTHONPATH": str(into / "path")}


def refuse_unknown_revision(parser: argparse.ArgumentParser, repo: Path, rev: str) -> None:
    """``parser.error`` (exit 2) when ``rev`` (a script's ``--baseline``; '' asks for none) names no commit of ``repo``:
    checked before anything is built or started, not as ``git archive``'s traceback minutes in."""
    if not rev:
        return
    if rev.startswith("-") or len(rev) > 200:
        parser.error(f"--baseline takes a git revision of this repository (a commit, a branch or a tag), not {rev[:200]!r}")
    found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], capture_output=True, timeout=30)
    if found.returncode != 0:
        parser.error(f"--baseline takes a git revision of this repository (a commit, a branch or a tag); {rev!r} names none here")
