"""``benchmarks/bench_planner_outcomes.py``: bad arguments are refused before any simulation, and our runs in
worker processes come back in the table's order, the same as in one process (two scenarios at 0 s cold
start: a few seconds once their static fleets are cached)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dynamo_fpm_testing.planner_support import run_benchmark

pytestmark = pytest.mark.runtime


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("bench_planner_outcomes.py", *args, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "0"], "--jobs 0: expected 1 or more"),
        (["--startups", "x"], "--startups 'x': expected seconds"),
        (["--config", '{"projection_cap": "lots"}'], "--config: "),
        (["--scenarios", "nope"], "unknown scenario 'nope'"),
        (["--seeds", "1,x"], "--seeds '1,x': expected integers"),
        (["--seeds", "1,1"], "a seed is listed twice"),
        (["--seed", "1", "--seeds", "1,2"], "--seed and --seeds: give one of them"),
    ],
)
def test_bad_arguments_exit_2_before_simulating(args: list[str], message: str) -> None:
    done = _bench(*args)
    assert done.returncode == 2
    assert message in done.stderr and done.stdout == ""


def test_runs_in_worker_processes_equal_one_process(tmp_path: Path) -> None:
    common = ["--scenarios", "flash-crowd,decode-shift", "--startups", "0", "--no-upstream"]
    rows = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        done = _bench(*common, "--jobs", jobs, "--json", str(out))
        assert done.returncode == 0, done.stderr
        saved = json.loads(out.read_text())
        # The table's order: each scenario's static fleet, then ours.
        assert [(r["scenario"], r["policy"].split()[0]) for r in saved] == [
            ("flash-crowd", "static"),
            ("flash-crowd", "ours"),
            ("decode-shift", "static"),
            ("decode-shift", "ours"),
        ]
        assert "acceptance: " in done.stdout
        rows[jobs] = [
            {k: r[k] for k in ("scenario", "policy", "goodput_pct", "gpu_hours", "flips")} for r in saved
        ]
    assert rows["1"] == rows["2"]


def test_several_seeds_are_run_and_judged_each_against_its_own_static_fleet(tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    args = ["--scenarios", "flash-crowd", "--startups", "0", "--no-upstream", "--jobs", "2"]
    done = _bench(*args, "--seeds", "0,1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
    assert [(r["seed"], r["policy"].split()[0]) for r in saved] == [
        (0, "static"),
        (0, "ours"),
        (1, "static"),
        (1, "ours"),
    ]
    lines = done.stdout.splitlines()
    assert "seed 0" in lines and "seed 1" in lines
    head = next(i for i, line in enumerate(lines) if line.startswith("acceptance: "))
    assert lines[head].endswith("targets met over seeds 0, 1")
    assert lines[head + 1].startswith("  seed 0: ") and lines[head + 2].startswith("  seed 1: ")
    # The same seed's rows are those a one-seed run writes.
    one = tmp_path / "one.json"
    assert _bench(*args, "--seed", "1", "--json", str(one)).returncode == 0
    keys = ("scenario", "policy", "goodput_pct", "gpu_hours")
    assert [{k: r[k] for k in keys} for r in json.loads(one.read_text())] == [
        {k: r[k] for k in keys} for r in saved if r["seed"] == 1
    ]
