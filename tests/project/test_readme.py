"""The README runs as pasted (tests/support/readme.py says how), and its module table is the tree.

This module runs every other section from the first, the demo, and the checks of the README's text;
test_readme_more.py runs the other sections (two modules: pytest-xdist gives them two workers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.readme import README, Section, half, run_section, sections


def test_every_skipped_block_says_why() -> None:
    skipped = [(s.title, first, why) for s in sections() for first, why in s.skipped]
    for title, first, why in skipped:
        print(f"README [{title}] not run: {first!r}: {why}")
        assert len(why) > 20, f"say why the block {first!r} cannot run here"
    assert sum(len(s.blocks) for s in sections()) >= 6  # most of the README runs


@pytest.mark.slow
@pytest.mark.parametrize("section", half(0), ids=lambda s: s.title)
def test_section_runs_as_pasted(section: Section, tmp_path: Path) -> None:
    run_section(section, tmp_path)


@pytest.mark.slow
def test_the_demo_runs_and_reports_json() -> None:
    """The first block's scripts/demo is `fabric demo` once .venv exists."""
    result = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "demo", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and any("all checks passed" in line for line in report["log"])
    # it says what it does: three adapters staged (it said one), and the work directory it prints is removed, saying so
    log = report["log"]
    staged = log[log.index("3. staging the three adapters on node1") + 1 : log.index("4. promoting across the cluster")]
    assert [line.split()[0] for line in staged] == ["support-v1", "sql-v2", "legal-v1"], log
    workdir = log[0].split("(work directory ")[1].split(",")[0]
    assert ", removed at the end" in log[0] and f"work directory {workdir} removed" in log and not Path(workdir).exists(), log


def test_module_table_names_every_module() -> None:
    table = README.read_text().split("| package | concept | modules |")[1]
    for package in sorted(p for p in (ROOT / "fabric").iterdir() if p.is_dir() and p.name not in ("v1", "__pycache__")):
        row = next((line for line in table.splitlines() if line.startswith(f"| `fabric/{package.name}/`")), None)
        assert row is not None, f"the README's module table has no row for fabric/{package.name}/"
        for module in sorted(package.glob("*.py")):
            if module.stem not in ("__init__", "__main__"):
                assert f"`{module.stem}`" in row, f"the README's row for fabric/{package.name}/ does not name {module.stem}"
