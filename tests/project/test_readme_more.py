"""The README's other sections run as pasted (the second of every two: tests/project/test_readme.py runs the
first), and the "Many teams" recipe's nodes serve nothing without a credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.readme import Section, half, run_script, run_section, sections, with_free_ports


@pytest.mark.slow
@pytest.mark.parametrize("section", half(1), ids=lambda s: s.title)
def test_section_runs_as_pasted(section: Section, tmp_path: Path) -> None:
    run_section(section, tmp_path)


@pytest.mark.slow
def test_the_many_teams_recipe_serves_nothing_without_a_credential(tmp_path: Path) -> None:
    """Issue 28 (5): the README's "Many teams" nodes, started as written, refuse an anonymous GetManifest, Locate, Fetch
    and data channel Fetch, each node, while team-a's token is served (tests/support/anonymous_probe.py)."""
    section = next(s for s in sections() if s.title == "Many teams")
    ports: dict[str, str] = {}
    start = with_free_ports(section.blocks[0], ports)
    assert "fabric promote" in start.rstrip().splitlines()[-1], "the section's first block ends with node 2's promote"
    nodes = " ".join(f"127.0.0.1:{ports[p]}" for p in ("50091", "50092"))
    probe = ROOT / "tests" / "support" / "anonymous_probe.py"
    code, output, _ = run_script(f"{start}\npython {probe} team-a/support-v3 teams/team-a.token {nodes}\nkill $(jobs -p) && wait\n", tmp_path)
    assert code == 0, f"the Many teams recipe served something without a credential, or did not run ({code}):\n{output}"
    for what in ("GetManifest", "Locate", "Fetch", "Fetch by digest", "Availability", "the data channel"):
        assert output.count(f"refused without a credential: {what} on ") == 2, output
