"""Running the README as pasted (tests/project/test_readme.py and test_readme_more.py): every ```bash and ```python
block, section by section, in a fresh directory.

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
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapter_fabric.harness.cluster import free_port
from tests.support import ROOT

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


# Sections a test of their own runs as pasted, with checks between their blocks (tests/project/test_readme_more.py).
RUN_BY_THEIR_OWN_TEST = ("Many teams",)


def half(which: int) -> list[Section]:
    """The sections that run blocks, every other one from the first (0) or the second (1): two test modules run them,
    so pytest-xdist (--dist loadfile) gives them two workers."""
    return [s for s in sections() if s.blocks and s.title not in RUN_BY_THEIR_OWN_TEST][which::2]


def with_free_ports(script: str, ports: dict[str, str]) -> str:
    """``script`` with each README port (127.0.0.1:5xxxx) replaced by a free one, the same one each time (``ports``)."""
    return PORT.sub(lambda m: "127.0.0.1:" + ports.setdefault(m.group(1), str(free_port())), script)


def run_script(script: str, tmp_path: Path) -> tuple[int, str, Path]:
    """Run ``script`` in ``bash -e`` in a fresh clone under ``tmp_path``, stopping every process it started after it:
    (exit code, output, the clone)."""
    clone = fresh_clone(tmp_path / "clone")
    log = tmp_path / "output.log"
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=clone, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = shell.wait(timeout=600)
        finally:
            stop_group(shell.pid)
    return code, log.read_text(), clone


def run_section(section: Section, tmp_path: Path, after_first_block: str = "") -> str:
    """Run one section's blocks as pasted; it exits 0, prints no traceback or warning, and leaves no file git or docker
    would take. ``after_first_block``: a check of the test's own, run between the first block and the next (its README
    ports become the same free ones). Returns the output."""
    blocks = [section.blocks[0], after_first_block, *section.blocks[1:]] if after_first_block else section.blocks
    script = with_free_ports("\n\n".join(blocks), {})
    code, output, clone = run_script(script, tmp_path)
    assert code == 0, f"README section {section.title!r} failed ({code}):\n{script}\n--- output ---\n{output}"
    assert "Traceback" not in output, output
    assert "Warning:" not in output, output  # a reader's first run shows no library's FutureWarning (issue 33)
    # What the blocks wrote (pki/, keys, the token, stores, logs, adapters) is neither committed by `git add -A`
    # nor shipped by `docker build .`.
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, capture_output=True, text=True, check=True).stdout
    assert status == "", f"README section {section.title!r} leaves files git would commit (add them to .gitignore):\n{status}"
    shipped = [p.name for p in clone.iterdir() if p.name not in (".git", ".gitignore", ".dockerignore") and not docker_ignores(p.name)]
    assert shipped == [], f"README section {section.title!r} writes {shipped}, which docker build . would send: add them to .dockerignore"
    return output




def fresh_clone(where: Path) -> Path:
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


def docker_ignores(name: str) -> bool:
    """Whether a top-level entry matches a .dockerignore pattern (Docker matches from the context's root; ``**/`` any depth)."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatchcase(name, pattern.removeprefix("**/")) for pattern in patterns)


def stop_group(pgid: int) -> None:
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
