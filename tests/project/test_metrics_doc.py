"""The README's Metrics table lists exactly the metrics a node registers, with their types and labels."""

from __future__ import annotations

import re

from tests.support import ROOT
from adapter_fabric.observability.metrics import catalog

README = ROOT / "README.md"


def _documented() -> set[tuple[str, str, tuple[str, ...]]]:
    text = README.read_text()
    section = text.split("\n### Metrics\n", 1)[1].split("\n### ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`fabric_"):
            rows.add((cells[0].strip("`"), cells[1], tuple(re.findall(r"`(\w+)`", cells[2]))))
    return rows


def test_the_readme_metrics_table_matches_the_registered_metrics() -> None:
    registered = {(m.name, m.kind, m.labels) for m in catalog()}
    documented = _documented()
    assert documented == registered, f"README lacks {registered - documented}; README has extra {documented - registered}"


def test_metric_names_follow_prometheus_conventions() -> None:
    for m in catalog():
        assert m.name.startswith("fabric_") and re.fullmatch(r"[a-z_]+", m.name)
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.kind == "histogram":
            assert m.name.endswith("_seconds"), m.name
        assert m.help.endswith("."), m.name
