"""The README's other sections run as pasted (the second of every two: tests/project/test_readme.py runs the
first), and the "Many teams" section, whose nodes serve nothing without a credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.readme import Section, half, run_section, sections


@pytest.mark.slow
@pytest.mark.parametrize("section", half(1), ids=lambda s: s.title)
def test_section_runs_as_pasted(section: Section, tmp_path: Path) -> None:
    run_section(section, tmp_path)


@pytest.mark.slow
def test_the_many_teams_section_runs_as_pasted_and_its_nodes_serve_nothing_without_a_credential(tmp_path: Path) -> None:
    """The section as pasted, and issue 28 (5) between its blocks: the nodes, started as written, refuse an anonymous
    GetManifest, Locate, Fetch and data channel Fetch, each node, while team-a's token is served
    (tests/support/anonymous_probe.py). One run of the section: its nodes and adapters cost ~20 CPU-seconds."""
    section = next(s for s in sections() if s.title == "Many teams")
    assert "fabric promote" in section.blocks[0].rstrip().splitlines()[-1], "the section's first block ends with node 2's promote"
    probe = ROOT / "tests" / "support" / "anonymous_probe.py"
    output = run_section(section, tmp_path, after_first_block=f"python {probe} team-a/support-v3 teams/team-a.token 127.0.0.1:50091 127.0.0.1:50092")
    for what in ("GetManifest", "Locate", "Fetch", "Fetch by digest", "Availability", "the data channel"):
        assert output.count(f"refused without a credential: {what} on ") == 2, output
