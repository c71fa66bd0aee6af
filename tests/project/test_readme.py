"""The README runs as pasted: every ```bash and ```python block, section by section, in a fresh directory; and its module table is the tree.

Blocks run as written, with two changes a reader's machine does not need: the
127.0.0.1 ports become free ones (other tests may hold the README's), and the
working directory is a temporary one with ``.venv`` linked to this suite's
environment (the clone a reader runs them in has its own). The blocks of one
``##`` section share one ``bash -e`` shell, as a reader pastes them in turn;
every process a section starts is stopped after it. A block preceded by
``<!-- readme-test: skip: REASON -->`` is not run, and the reason is reported.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import ROOT
from adapter_fabric.harness.cluster import free_port

README = ROOT / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->")
PORT = re.compile(r"127\.0\.0\.1:(5\d{4})")


@dataclass
class Section:
    title: str
    blocks: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (first line, reason)


def sections() -> list[Section]:
    found: list[Section] = []
    lines = README.read_text().splitlines()
    i, pending_skip, title = 0, None, "(top)"
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            title = line[3:].strip()
        elif SKIP.search(line):
            pending_skip = SKIP.search(line).group(1)
        elif line.strip() in ("```bash", "```python"):
            end = lines.index("```", i + 1)
            block = "\n".join(lines[i + 1 : end])
            if line.strip() == "```python":  # run by the section's shell, in its .venv, as a reader runs it after the bash before
                block = f"python - <<'PY'\n{block}\nPY"
            if not found or found[-1].title != title:
                found.append(Section(title))
            if pending_skip:
                found[-1].skipped.append((block.splitlines()[0], pending_skip))
            else:
                found[-1].blocks.append(block)
            pending_skip, i = None, end
        elif line.strip():
            pending_skip = None if not line.startswith("<!--") else pending_skip
        i += 1
    return found


def test_every_skipped_block_says_why() -> None:
    skipped = [(s.title, first, why) for s in sections() for first, why in s.skipped]
    for title, first, why in skipped:
        print(f"README [{title}] not run: {first!r}: {why}")
        assert len(why) > 20, f"say why the block {first!r} cannot run here"
    assert sum(len(s.blocks) for s in sections()) >= 6  # most of the README runs


@pytest.mark.slow
@pytest.mark.parametrize("section", [s for s in sections() if s.blocks], ids=lambda s: s.title)
def test_section_runs_as_pasted(section: Section, tmp_path: Path) -> None:
    ports: dict[str, str] = {}
    script = PORT.sub(lambda m: "127.0.0.1:" + ports.setdefault(m.group(1), str(free_port())), "\n\n".join(section.blocks))
    clone = _fresh_clone(tmp_path / "clone")
    log = tmp_path / "output.log"
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=clone, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = shell.wait(timeout=600)
        finally:
            _stop_group(shell.pid)
    output = log.read_text()
    assert code == 0, f"README section {section.title!r} failed ({code}):\n{script}\n--- output ---\n{output}"
    assert "Traceback" not in output, output
    assert "Warning:" not in output, output  # a reader's first run shows no library's FutureWarning (issue 33)
    # What the blocks wrote (pki/, keys, the token, stores, logs, adapters) is neither committed by `git add -A`
    # nor shipped by `docker build .`.
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, capture_output=True, text=True, check=True).stdout
    assert status == "", f"README section {section.title!r} leaves files git would commit (add them to .gitignore):\n{status}"
    shipped = [p.name for p in clone.iterdir() if p.name not in (".git", ".gitignore", ".dockerignore") and not _docker_ignores(p.name)]
    assert shipped == [], f"README section {section.title!r} writes {shipped}, which docker build . would send: add them to .dockerignore"


@pytest.mark.slow
def test_the_many_teams_recipe_serves_nothing_without_a_credential(tmp_path: Path) -> None:
    """Issue 28 (5): the README's "Many teams" nodes, started as written, refuse an anonymous GetManifest, Locate, Fetch
    and data channel Fetch, each node, while team-a's token is served (tests/support/anonymous_probe.py)."""
    section = next(s for s in sections() if s.title == "Many teams")
    ports: dict[str, str] = {}
    start = PORT.sub(lambda m: "127.0.0.1:" + ports.setdefault(m.group(1), str(free_port())), section.blocks[0])
    assert "fabric promote" in start.rstrip().splitlines()[-1], "the section's first block ends with node 2's promote"
    nodes = " ".join(f"127.0.0.1:{ports[p]}" for p in ("50091", "50092"))
    probe = ROOT / "tests" / "support" / "anonymous_probe.py"
    script = f"{start}\npython {probe} team-a/support-v3 teams/team-a.token {nodes}\nkill $(jobs -p) && wait\n"
    clone = _fresh_clone(tmp_path / "clone")
    log = tmp_path / "output.log"
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=clone, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = shell.wait(timeout=600)
        finally:
            _stop_group(shell.pid)
    output = log.read_text()
    assert code == 0, f"the Many teams recipe served something without a credential, or did not run ({code}):\n{output}"
    for what in ("GetManifest", "Locate", "Fetch", "Fetch by digest", "Availability", "the data channel"):
        assert output.count(f"refused without a credential: {what} on ") == 2, output


def _fresh_clone(where: Path) -> Path:
    """A git repository holding the project's ignore files, committed, with ``.venv`` linked to this suite's environment."""
    where.mkdir()
    for name in (".gitignore", ".dockerignore"):
        (where / name).write_bytes((ROOT / name).read_bytes())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=where, check=True)
    subprocess.run([*git, "add", ".gitignore", ".dockerignore"], cwd=where, check=True)
    subprocess.run([*git, "commit", "-qm", "ignore files"], cwd=where, check=True)
    (where / ".venv").symlink_to(Path(sys.prefix))
    return where


def _docker_ignores(name: str) -> bool:
    """Whether a top-level entry matches a .dockerignore pattern (Docker matches from the context's root; ``**/`` any depth)."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatchcase(name, pattern.removeprefix("**/")) for pattern in patterns)


def _stop_group(pgid: int) -> None:
    """SIGTERM every process the section started (nodes run in the background), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


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
