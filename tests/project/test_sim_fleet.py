"""scripts/sim_fleet.py at a small size, in-process: the real placement, lookup, eviction and re-homing code keeps its
goals on a simulated fleet (these are counts of the policy's own decisions, not timings)."""

from __future__ import annotations

import importlib.util
import statistics
import sys

from tests.support import ROOT


def _sim_module():
    spec = importlib.util.spec_from_file_location("sim_fleet", ROOT / "scripts" / "sim_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_small_fleet_keeps_the_goals_of_the_big_one(capsys) -> None:
    sim_fleet = _sim_module()
    args = sim_fleet.argparse.Namespace(
        nodes=60, adapters=3000, requests=6000, homes=3, zipf=1.0, rate=500.0, churn=6, capacity_share=0.5,
        link=1.25e9, rtt=0.0005, origin_latency=0.05, origin_rate=200e6, seed=3,
    )  # fmt: skip
    sim = sim_fleet.Sim(args)
    tally = sim.run()
    assert tally.hits + tally.misses == 6000 and tally.misses > 0
    assert statistics.median(tally.lookups) <= args.homes + 1
    assert set(tally.origin_fetches.values()) == {1}  # each adapter fetched from the origin once, however many asked
    assert tally.evicted_last == 0 and tally.evict_asks > 0  # evictions ran, and never dropped a last copy
    assert 0 < tally.announces and tally.announces_max <= 128  # holders told the new homes, within a node's bound per change
    for kind, _, _, homes_moved, homes in tally.moves:
        members = len(sim.nodes)
        assert homes_moved / homes < 3 / members, kind  # about 1/n of the homes moved per change
    print(sim_fleet.report(sim, 0.0))
    assert "lookups per miss" in capsys.readouterr().out
