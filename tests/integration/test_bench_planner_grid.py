"""``benchmarks/bench_planner_grid.py``: bad grids are refused before any simulation, and a real point on
the real simulator is judged against the targets (one scenario, instant starts: a few seconds)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dynamo_fpm_testing.planner_support import run_benchmark

pytestmark = pytest.mark.runtime


def _grid(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("bench_planner_grid.py", *args, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "headroom_sigmas"], "expected key=value,value"),
        (["--grid", "headroom_sigmas=x"], "headroom_sigmas"),
        (["--grid", "forecast.enabled=sideways"], "forecast.enabled"),
        (["--grid", "headroom_sigmas=2", "--scenarios", "nope"], "unknown scenario 'nope'"),
        (["--grid", "headroom_sigmas=2", "--startups", "x"], "--startups 'x': expected seconds"),
        (["--grid", "headroom_sigma=2"], "headroom_sigma: unknown option"),
        (["--grid", "headroom_sigmas=2", "--seeds", "0,zero"], "--seeds '0,zero': expected integers"),
    ],
)
def test_bad_grids_exit_2_before_simulating(args: list[str], message: str) -> None:
    done = _grid(*args)
    assert done.returncode == 2
    assert message in done.stderr and done.stdout == ""


def test_a_point_is_judged_on_the_real_simulator(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    done = _grid(
        "--grid",
        "headroom_sigmas=2",
        "--grid",
        "decode.max_replicas=1,8",
        "--scenarios",
        "flash-crowd",
        "--startups",
        "0",
        "--no-upstream",
        "--jobs",
        "1",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 2
    saved = json.loads(out.read_text())
    points = {p["point"]["decode.max_replicas"]: p for p in saved["points"]}
    # One decode replica cannot carry the 8x crowd at 0 s cold start; eight can (docs: 99.7%).
    assert points[1]["runs"][0]["peak_replicas"]["decode"] == 1
    assert any(m["criterion"] == "goodput" for m in points[1]["missed"])
    assert points[8]["runs"][0]["goodput_pct"] >= 97.0
    assert points[8]["met"] > points[1]["met"]
    assert "most targets met: headroom_sigmas=2 decode.max_replicas=8" in done.stdout


def test_each_seed_is_judged_and_counted(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    flags = "--grid decode.max_replicas=8 --scenarios flash-crowd --startups 0 --seeds 0,1 --no-upstream"
    done = _grid(*flags.split(), "--jobs", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("[")]
    saved = json.loads(out.read_text())
    (point,) = saved["points"]
    assert [r["seed"] for r in point["runs"]] == [0, 1]
    assert sorted(b["seed"] for b in saved["baselines"]) == [0, 1]  # each seed's own static fleet
    # 4 targets per seed at 0 s (goodput, GPU-hours, 2 direction changes), counted per seed.
    per_seed = [sum(1 for r in point["runs"] if r["seed"] == s) for s in (0, 1)]
    assert per_seed == [1, 1] and point["targets"] == 8
    assert f"{point['met']} of 8 met (seed 0: " in line and ", seed 1: " in line
