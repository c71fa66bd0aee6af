"""Lint and types: ruff and mypy over fabric/ and node/, with the settings in pyproject.toml; scripts/test (CI) fails on a regression.

The folders install as ``adapter_fabric`` and ``adapter_fabric.node`` (setup.py maps them), which a type checker
cannot follow from the source tree, and the editable install's import hook is invisible to it: mypy reads a tree
of links instead, ``adapter_fabric/`` holding fabric/'s entries and ``node`` (``typing_tree``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


def typing_tree(at: Path) -> Path:
    """A directory where ``adapter_fabric`` is fabric/ with node/ inside it, as installed (links, nothing copied)."""
    package = at / "adapter_fabric"
    package.mkdir()
    for entry in (ROOT / "fabric").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "node").symlink_to(ROOT / "node")
    shutil.copy(ROOT / "pyproject.toml", at / "pyproject.toml")
    return at


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "fabric", "node"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.slow  # ~1 min without a cache: the quick tier leaves it to the whole suite
def test_mypy_finds_nothing(tmp_path: Path) -> None:
    tree = typing_tree(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "-p", "adapter_fabric"],
        cwd=tree, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
