"""The benchmarks' own bounds: a flag past its bound is refused by name before anything is built or started (each script's
cases run in one process of their own: its imports once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (script, flag, a value under its bound, a value over it, the refusal's words); every documented run is inside
BOUNDS = [
    ("bench_cache.py", "--nodes", "2", "65", "--nodes takes 3 to 64"),
    ("bench_cache.py", "--adapters", "9", "100001", "--adapters takes 10 to 100000"),
    ("bench_cache.py", "--requests", "0", "1000001", "--requests takes 1 to 1000000"),
    ("bench_cache.py", "--in-flight", "0", "65", "--in-flight takes 1 to 64"),
    ("bench_cache.py", "--baseline", "0", "1001", "--baseline takes 1 to 1000"),
    ("bench_cache.py", "--jobs", "0", "17", "--jobs takes 1 to 16"),
    ("bench_cache.py", "--zipf", "-0.5", "3.5", "--zipf takes 0 to 3"),
    ("bench_cache.py", "--cache-share", "0.001", "1.5", "--cache-share takes 0.01 to 1"),
    ("bench_cache.py", "--warmup", "-0.1", "0.95", "--warmup takes 0 to 0.9"),
    ("bench_cache.py", "--homes", "-1", "9", "--homes takes 0 (node 0 holds the adapters"),
    ("bench_listing.py", "--nodes", "7", "200001", "--nodes takes 0 (in-process) or 8 to 200000"),
    ("bench_listing.py", "--sizes", "0", "1000,200001", "--sizes takes store sizes separated by commas, each 1 to 200000"),
    ("bench_listing.py", "--page", "0", "5001", "--page takes 1 to 5000"),
    ("bench_listing.py", "--reps", "0", "1001", "--reps takes 1 to 1000"),
    ("bench_listing.py", "--rounds", "0", "51", "--rounds takes 1 to 50"),
    ("bench_metadata.py", "--counts", "0", "1000,200001", "--counts takes adapter counts separated by commas"),
    ("bench_metadata.py", "--probes", "0", "101", "--probes takes 1 to 100"),
    ("bench_metadata.py", "--page-size", "-1", "5001", "--page-size takes 0 to 5000"),
    ("bench_metadata.py", "--jobs", "0", "17", "--jobs takes 1 to 16"),
    ("bench_node_start.py", "--nodes", "0", "51", "--nodes takes 1 to 50"),
    ("bench_origins.py", "--size-mib", "0", "2049", "--size-mib takes 1 to 2048"),
    ("bench_origins.py", "--rounds", "0", "1001", "--rounds takes 1 to 1000"),
    ("bench_pool.py", "--reps", "0", "1001", "--reps takes 1 to 1000"),
    ("bench_pool.py", "--batch", "0", "257", "--batch takes 1 to 256"),
    ("bench_pool.py", "--seq", "0", "257", "--seq takes 1 to 256"),
    ("bench_pool.py", "--threads", "-1", "257", "--threads takes 0 to 256"),
    ("bench_pool.py", "--rounds", "0", "51", "--rounds takes 1 to 50"),
    ("bench_members.py", "--members", "0", "33", "--members takes 1 to 32"),
    ("bench_members.py", "--rounds", "0", "1001", "--rounds takes 1 to 1000"),
    ("bench_promote.py", "--rounds", "0", "1001", "--rounds takes 1 to 1000"),
    ("bench_stage.py", "--adapters", "0", "20001", "--adapters takes 1 to 20000"),
    ("bench_stage.py", "--workers", "0", "65", "--workers takes 1 to 64"),
    ("bench_stage.py", "--rounds", "0", "51", "--rounds takes 1 to 50"),
    ("bench_swarm.py", "--nodes", "1", "8,65", "--nodes takes node counts separated by commas, each 2 to 64"),
    ("bench_swarm.py", "--rate-mbit", "9", "10001", "--rate-mbit takes 10 to 10000"),
    ("bench_swarm.py", "--size-mib", "0", "1025", "--size-mib takes 1 to 1024"),
    ("bench_swarm.py", "--chunk-kib", "3", "4097", "--chunk-kib takes 4 to 4096"),
    ("bench_swarm.py", "--rounds", "0", "51", "--rounds takes 1 to 50"),
    ("bench_swarm.py", "--idle-s", "-1", "601", "--idle-s takes 0 to 600"),
    ("bench_swarm.py", "--mtu", "67", "65536", "--mtu takes 0 (the kernel's 1500) or 68 to 65535"),
    ("bench_transfer.py", "--mib", "0", "4097", "--mib takes 1 to 4096"),
    ("bench_transfer.py", "--rounds", "0", "1001", "--rounds takes 1 to 1000"),
    ("sim_fleet.py", "--nodes", "1", "20001", "--nodes takes 2 to 20,000"),
    ("sim_fleet.py", "--adapters", "49", "200001", "--adapters takes 50 to 200,000"),
    ("sim_fleet.py", "--requests", "0", "1000001", "--requests takes 1 to 1,000,000"),
    ("sim_fleet.py", "--homes", "0", "65", "--homes takes 1 to 64"),
    ("sim_fleet.py", "--zipf", "-0.1", "3.1", "--zipf takes 0 to 3"),
    ("sim_fleet.py", "--rate", "0", "2e9", "--rate takes 0.01 to 1,000,000,000"),
    ("sim_fleet.py", "--churn", "-1", "1001", "--churn takes 0 to 1,000"),
    ("sim_fleet.py", "--capacity-share", "0.001", "101", "--capacity-share takes 0.01 to 100"),
    ("sim_fleet.py", "--link", "999999", "1e13", "--link takes 1,000,000 to 1,000,000,000,000"),
    ("sim_fleet.py", "--rtt", "-0.1", "11", "--rtt takes 0 to 10"),
    ("sim_fleet.py", "--origin-latency", "-1", "601", "--origin-latency takes 0 to 600"),
    ("sim_fleet.py", "--origin-rate", "1e5", "1e13", "--origin-rate takes 1,000,000 to 1,000,000,000,000"),
    ("sim_fleet.py", "--seed", "-1", "4294967296", "--seed takes 0 to 4,294,967,295"),
    ("soak_trust.py", "--seconds", "0.5", "86401", "--seconds takes 1 to 86400"),
    ("swarm_ideal.py", "--size", "0", "4294967297", "--size takes 1 to 4294967296"),
    ("swarm_ideal.py", "--children", "-1", "64", "--children takes 0 to 63"),
]
#: what a script needs besides the flag under test to reach its bounds (swarm_ideal.py: its required flags)
NEEDS = {"bench_listing.py": ["--nodes", "10"], "swarm_ideal.py": ["--forward", "--host", "127.0.0.1", "--size", "10", "--children", "0", "--source", "absent"]}
#: refusals beside the bounds above: a float that is no number, a word no flag takes, a file that is not there
OTHERS = [
    ("bench_listing.py", ["--nodes", "10", "--quotas", "1001"], "--quotas takes 1 to 1000"),
    ("bench_listing.py", ["--nodes", "10", "--quotas", "0"], "--quotas takes 1 to 1000"),
    ("bench_listing.py", ["--sizes", "1000,lots"], "--sizes takes store sizes"),
    ("bench_metadata.py", ["--counts", "100000,1000"], "--counts takes adapter counts separated by commas, smallest first"),
    ("bench_cache.py", ["--zipf", "nan"], "--zipf takes 0 to 3"),
    ("bench_swarm.py", ["--rate-mbit", "nan"], "--rate-mbit takes 10 to 10000"),
    ("bench_swarm.py", ["--idle-s", "inf"], "--idle-s takes 0 to 600"),
    ("bench_swarm.py", ["--mtu", "-1"], "--mtu takes 0 (the kernel's 1500) or 68 to 65535"),
    ("sim_fleet.py", ["--link", "nan"], "--link takes 1,000,000 to"),
    ("sim_fleet.py", ["--origin-latency", "inf"], "--origin-latency takes 0 to 600"),
    ("soak_trust.py", ["--seconds", "nan"], "--seconds takes 1 to 86400"),
    ("soak_trust.py", ["--seconds", "inf"], "--seconds takes 1 to 86400"),
    ("bench_pool.py", ["--sections", "swap,nap"], "--sections takes swap, load, forward"),
    ("bench_pool.py", ["--device", "tpu"], "--device takes auto, cpu, cuda"),
    ("bench_stage.py", ["--dir", "absent"], "--dir takes a directory that exists"),
    # a --baseline that names no commit is refused before a node starts, not by git archive's traceback minutes in
    *((script, [*NEEDS.get(script, []), f"--baseline={rev}"], f"--baseline takes a git revision of this repository{words}")
      for script in ("bench_listing.py", "bench_members.py", "bench_pool.py", "bench_stage.py", "bench_swarm.py")
      for rev, words in (("no-such-revision", " (a commit, a branch or a tag); 'no-such-revision' names none here"), ("--all", ""))),
    ("swarm_ideal.py", ["--forward", "--host", "127.0.0.1", "--size", "10", "--children", "0"], "--forward takes --source (the seed) or --parent and --out"),
    ("swarm_ideal.py", [*NEEDS["swarm_ideal.py"]], "--source takes the file to send"),
]
#: the environment's variables a script reads, past their bounds
VARIABLES = [
    ("bench_promote.py", {"BENCH_WINDOW": "0"}, "BENCH_WINDOW takes 1 to 8"),
    ("bench_promote.py", {"BENCH_WINDOW": "9"}, "BENCH_WINDOW takes 1 to 8"),
    ("bench_promote.py", {"BENCH_WINDOW": "two"}, "BENCH_WINDOW takes 1 to 8"),
]
#: script -> its cases: (argv, the refusal's words, the environment's variables set for it)
CASES: dict[str, list[tuple[list[str], str, dict[str, str]]]] = {}
for _script, _flag, _under, _over, _words in BOUNDS:
    CASES.setdefault(_script, []).extend(([*NEEDS.get(_script, []), _flag, value], _words, {}) for value in (_under, _over))
for _script, _flags, _words in OTHERS:
    CASES.setdefault(_script, []).append((_flags, _words, {}))
for _script, _variables, _words in VARIABLES:
    CASES.setdefault(_script, []).append(([], _words, _variables))

#: runs one script's cases in one process (its imports, torch among them, once): its ``main`` under each argv and
#: environment, the exit code and what it wrote to stderr; a case that does not exit stops the run (the test's timeout
#: bounds it)
DRIVER = """
import contextlib, importlib.util, io, json, os, sys, traceback
script, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))  # as when the script is run: its folder first
spec = importlib.util.spec_from_file_location("script_under_test", script)
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(module)
answers = []
for argv, variables in cases:
    sys.argv, err = [script, *argv], io.StringIO()
    os.environ.update(variables)
    try:
        with contextlib.redirect_stderr(err):
            module.main()
        code = "returned"
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code, err = "raised", io.StringIO(traceback.format_exc())
    for name in variables:
        del os.environ[name]
    answers.append([code, err.getvalue()])
print(json.dumps(answers))
"""


@pytest.mark.parametrize("script", sorted(CASES))
def test_a_flag_past_its_bound_is_refused_by_name(tmp_path: Path, script: str) -> None:
    cases = CASES[script]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(ROOT / "scripts" / script), json.dumps([[argv, variables] for argv, _, variables in cases])],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for (argv, words, variables), (code, stderr) in zip(cases, json.loads(done.stdout.splitlines()[-1]), strict=True):
        assert code == 2 and words in stderr and "Traceback" not in stderr, (argv, variables, code, stderr[-2000:])
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_every_benchmark_with_numeric_flags_has_its_bounds_here() -> None:
    """A script that takes a number names its bounds in BOUNDS (stage_adapter.py is the fabric CLI's stage: its own)."""
    numeric = {path.name for path in (ROOT / "scripts").glob("*.py") if "type=int" in path.read_text() or "type=float" in path.read_text()}
    assert numeric <= {script for script, *_ in BOUNDS}, numeric - {script for script, *_ in BOUNDS}
