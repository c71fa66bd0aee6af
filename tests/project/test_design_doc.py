"""docs/ARCHITECTURE.md is code too: every invariant names the tests that hold it, and each named test exists."""

from __future__ import annotations

import ast
import re

from tests.support import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _invariants() -> dict[int, str]:
    """Invariant number -> its text, from the numbered list under "## Invariants"."""
    section = DOC.read_text().split("## Invariants", 1)[1].split("\n## ", 1)[0]
    found: dict[int, str] = {}
    for match in re.finditer(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", section, re.M | re.S):
        found[int(match.group(1))] = match.group(2)
    return found


def _tests_named(text: str) -> list[tuple[str, str]]:
    """Each ``tests/...py`` (optionally ``::name``) the text names, with the module it last named for a bare ``::name``."""
    named, module = [], ""
    for match in re.finditer(r"`((?:tests/[\w/]+\.py|test_\w+\.py))?(?:::(\w+))?`", text):
        path, name = match.group(1), match.group(2)
        if path:
            module = path if path.startswith("tests/") else next(str(p.relative_to(ROOT)) for p in ROOT.glob(f"tests/**/{path}"))
        if path or name:
            named.append((module, name or ""))
    return named


def test_the_invariants_are_numbered_in_order_and_each_names_a_test_that_exists() -> None:
    invariants = _invariants()
    assert sorted(invariants) == list(range(1, len(invariants) + 1)) and len(invariants) >= 17
    for number, text in invariants.items():
        named = _tests_named(text)
        assert named, f"invariant {number} names no test"
        for module, name in named:
            path = ROOT / module
            assert path.is_file(), f"invariant {number} names {module}, which does not exist"
            if name:
                defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                assert name in defined, f"invariant {number} names {module}::{name}, which is not a test there"
