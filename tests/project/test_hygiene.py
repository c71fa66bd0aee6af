"""Following the README leaves nothing secret for git or a Docker build to pick up.

Every path a README block writes into the clone (``--store X``, ``--export-dir X``,
``make-adapter X``, ``keygen X``, the ``pki/`` directory and its token) must be
ignored by git and by the Docker build context.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess

from tests.support import ROOT

WRITES = re.compile(r"(?:--store|--export-dir|make-adapter)\s+([A-Za-z0-9][\w.-]*)")
SECRETS = ["pki/ca.key", "pki/token", "pki/node1.key", "pki/operator.key", "author.key", "author.pub", "token", "node.log"]


def _written() -> list[str]:
    text = (ROOT / "README.md").read_text()
    # a file inside each directory: git matches a pattern like /n1/ only against a directory
    found = {f"{name}/adapter_model.safetensors" for name in WRITES.findall(text) if name not in ("DIR", "tiny")}
    found |= {f"{name}.key" for name in re.findall(r"fabric keygen ([\w-]+)", text)}
    return sorted(found | set(SECRETS))


def _docker_ignored(path: str) -> bool:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    top = path.split("/")[0]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(top, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_the_readme_writes_the_paths_this_test_knows() -> None:
    written = _written()
    assert {"n1/adapter_model.safetensors", "support-v3/adapter_model.safetensors", "exported/adapter_model.safetensors", "author.key"} <= set(written)


def test_everything_the_readme_writes_is_ignored_by_git_and_docker() -> None:
    written = _written()
    checked = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    ignored = set(checked.stdout.split())
    assert ignored == set(written), f"not in .gitignore: {sorted(set(written) - ignored)}"
    assert [p for p in written if not _docker_ignored(p)] == []
