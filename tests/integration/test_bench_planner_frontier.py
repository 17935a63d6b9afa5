"""``benchmarks/bench_planner_frontier.py --overshoot``: a bad grid is refused before any simulation, and a
small grid on the real simulator prints its front and writes every point (the decode shift, instant starts:
a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dynamo_fpm_testing.planner_support import run_benchmark

pytestmark = pytest.mark.runtime


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--extras", "0,1"], "--extras: expected comma-separated whole numbers >= 1, got '0,1'"),
        (["--extras", "one"], "--extras: expected comma-separated whole numbers >= 1, got 'one'"),
        (["--holds", "60,-1"], "--holds: expected comma-separated seconds > 0, got '60,-1'"),
        (["--ample", "0"], "--ample: expected a whole number >= 1, got 0"),
    ],
)
def test_a_bad_grid_is_refused_in_one_line(args: list[str], message: str) -> None:
    out = run_benchmark("bench_planner_frontier.py", "--overshoot", *args, timeout=120)
    assert (out.returncode, out.stdout, out.stderr.strip()) == (2, "", message)


def test_a_small_grid_prints_its_front_and_writes_every_point(tmp_path: Path) -> None:
    saved = tmp_path / "front.json"
    args = ["--scenarios", "decode-shift", "--startups", "60", "--overshoot", "--extras", "1,2"]
    out = run_benchmark(
        "bench_planner_frontier.py", *args, "--holds", "30,120", "--json", str(saved), timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    front = [line.split() for line in out.stdout.splitlines() if line.endswith("(overshoot front)")]
    assert front and front[0][2] == "reactive", out.stdout
    costs = [float(row[-3]) for row in front]
    assert costs == sorted(costs)  # cheapest first
    assert "overshoot fleet 5 of 5" in out.stderr
    rows = [r for r in json.loads(saved.read_text()) if r["fleet"] == "overshoot"]
    assert [(r["extra"], r["hold_s"]) for r in rows] == [
        (0, 0.0),
        (1, 30.0),
        (1, 120.0),
        (2, 30.0),
        (2, 120.0),
    ]
    by = {(r["extra"], r["hold_s"]): r for r in rows}
    # Held less than the 60 s cold start, the extra replicas never serve: the reactive fleet's goodput.
    assert by[(2, 30.0)]["goodput_pct"] == by[(0, 0.0)]["goodput_pct"]
    assert by[(2, 120.0)]["goodput_pct"] > by[(0, 0.0)]["goodput_pct"]
