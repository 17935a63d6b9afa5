"""The outcome targets as data: peaks of a scenario's load, the direction changes they allow, and the
verdict on a benchmark's rows (each target met and missed at its edge; a target without its reference
left out)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from dynamo.planner.sim.acceptance import allowed_flips, check, load_peaks, report
from dynamo.planner.sim.scenarios import SCENARIOS, Phase, Scenario
from dynamo_fpm_testing.planner_support import run_benchmark


def _scenario(*phases: Phase) -> Scenario:
    return Scenario("synthetic", "for a test", phases)


@pytest.mark.parametrize(
    ("name", "prefill", "decode"),
    [
        ("decode-shift", 0, 1),  # prompts never change; outputs grow once
        ("idle-gap", 2, 2),  # 6 req/s, nothing, 6 req/s
        ("opposite-shift", 1, 2),  # decode is high at both ends, low in the middle
        ("slow-wave", 3, 3),  # three 5-minute periods in 15 minutes
        ("steady", 0, 0),  # one constant phase: any change of direction is one too many
        ("fleet-scale", 1, 1),
    ],
)
def test_peaks_of_the_suites_loads(name: str, prefill: int, decode: int) -> None:
    scenario = SCENARIOS[name]
    assert (load_peaks(scenario, "prefill"), load_peaks(scenario, "decode")) == (prefill, decode)


def test_peaks_of_plateaus_and_edges() -> None:
    flat = _scenario(Phase(60, 4, 1000, 100), Phase(60, 4, 1000, 100))
    assert load_peaks(flat, "prefill") == 0 and allowed_flips(flat, "prefill") == 0
    staircase = _scenario(*(Phase(60, r, 1000, 100) for r in (2, 4, 4, 8, 4, 2)))
    assert load_peaks(staircase, "decode") == 1 and allowed_flips(staircase, "decode") == 1
    falling = _scenario(Phase(60, 8, 1000, 100), Phase(60, 2, 1000, 100))
    assert load_peaks(falling, "prefill") == 1  # a high start is a peak
    # Output lengths change the decode load at a constant rate; prompt lengths do not.
    outputs = _scenario(Phase(60, 4, 1000, 100), Phase(60, 4, 1000, 900), Phase(60, 4, 1000, 100))
    assert (load_peaks(outputs, "prefill"), load_peaks(outputs, "decode")) == (0, 1)
    two = _scenario(*(Phase(60, r, 1000, 100) for r in (1, 5, 1, 5, 1)))
    assert allowed_flips(two, "prefill") == 3  # up, down, up, down


def _ours(scenario: str, startup: float, goodput: float, gpu_h: float, **flips: int) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "startup_s": startup,
        "policy": "ours",
        "goodput_pct": goodput,
        "gpu_hours": gpu_h,
        "flips": {"prefill": flips.get("prefill", 0), "decode": flips.get("decode", 0)},
    }


STATIC: dict[str, Any] = {
    "scenario": "ramp",
    "startup_s": None,
    "policy": "static 5+5",
    "goodput_pct": 100.0,
    "gpu_hours": 2.0,
}
UPSTREAM: dict[str, Any] = {
    "scenario": "ramp",
    "startup_s": 60.0,
    "policy": "upstream-1.6.1",
    "goodput_pct": 24.2,
    "gpu_hours": 1.0,
}


def _verdicts(rows: list[dict[str, Any]]) -> dict[tuple[str, float], bool]:
    return {(c.criterion, c.startup_s): c.met for c in check(rows)}


def test_each_target_at_its_edge() -> None:
    at_edge = [STATIC, UPSTREAM, _ours("ramp", 60.0, 90.0, 2.5, decode=1), _ours("ramp", 0.0, 97.0, 2.1)]
    assert _verdicts(at_edge) == {
        ("goodput", 60.0): True,
        ("goodput >= upstream", 60.0): True,
        ("GPU-hours / static", 60.0): True,
        ("prefill direction changes", 60.0): True,
        ("decode direction changes", 60.0): True,
        ("goodput", 0.0): True,
        ("GPU-hours / static", 0.0): True,
        ("prefill direction changes", 0.0): True,
        ("decode direction changes", 0.0): True,
    }
    past = [
        STATIC,
        {**UPSTREAM, "goodput_pct": 89.95},
        _ours("ramp", 60.0, 89.9, 2.5001, decode=2),
        _ours("ramp", 0.0, 96.9, 2.1001, prefill=2),
    ]
    missed = {k for k, met in _verdicts(past).items() if not met}
    assert missed == {
        ("goodput", 60.0),
        ("goodput >= upstream", 60.0),
        ("GPU-hours / static", 60.0),
        ("decode direction changes", 60.0),
        ("goodput", 0.0),
        ("GPU-hours / static", 0.0),
        ("prefill direction changes", 0.0),
    }


def test_targets_without_a_reference_are_left_out() -> None:
    rows = [_ours("idle-gap", 60.0, 50.0, 0.8), _ours("ramp", 180.0, 20.0, 9.9, decode=7)]
    criteria = {(c.scenario, c.startup_s, c.criterion) for c in check(rows)}
    # No static fleet, no upstream row, no goodput target for the idle gap, none at 180 s but flapping.
    assert criteria == {
        ("idle-gap", 60.0, "prefill direction changes"),
        ("idle-gap", 60.0, "decode direction changes"),
        ("ramp", 180.0, "prefill direction changes"),
        ("ramp", 180.0, "decode direction changes"),
    }
    assert check([{**_ours("not-in-the-suite", 60.0, 50.0, 1.0)}]) == []


def test_report_lists_the_missed_first() -> None:
    text = report(check([STATIC, _ours("ramp", 60.0, 80.0, 2.0)]))
    lines = text.splitlines()
    assert lines[0] == "acceptance: 3 of 4 targets met"
    assert lines[1].startswith("MISSED ramp") and "80.0%" in lines[1] and ">= 90%" in lines[1]
    assert all(line.startswith("met") for line in lines[2:])


def test_each_seed_is_judged_against_its_own_references() -> None:
    # The same run of ours is within 1.25x of seed 0's static fleet and past seed 1's (a cheaper trace).
    rows = [
        {**STATIC, "seed": 0},
        {**_ours("ramp", 60.0, 91.0, 2.5), "seed": 0},
        {**STATIC, "gpu_hours": 1.9, "seed": 1},
        {**_ours("ramp", 60.0, 91.0, 2.5), "seed": 1},
    ]
    verdicts = {(c.seed, c.criterion): c.met for c in check(rows)}
    assert verdicts[(0, "GPU-hours / static")] and not verdicts[(1, "GPU-hours / static")]
    assert verdicts[(0, "goodput")] and verdicts[(1, "goodput")]
    lines = report(check(rows)).splitlines()
    assert lines[0] == "acceptance: 7 of 8 targets met over seeds 0, 1"
    assert lines[1:3] == ["  seed 0: 4 of 4 met", "  seed 1: 3 of 4 met"]
    assert lines[3] == (
        "  missed on 1 of 2 seeds: ramp 60 s GPU-hours / static: seed 1 1.316x (target <= 1.25x)"
    )
    assert lines[4].startswith("MISSED seed 1  ramp")
    # Rows without a seed (files written before seeds) are one group, as before.
    assert report(check([STATIC, _ours("ramp", 60.0, 91.0, 2.5)])).splitlines()[0] == (
        "acceptance: 4 of 4 targets met"
    )


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("bench_planner_outcomes.py", *args, timeout=120)


def test_the_benchmark_judges_a_saved_run(tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps([STATIC, _ours("ramp", 60.0, 80.0, 2.0)]))
    done = _bench("--check", str(saved))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "acceptance: 3 of 4 targets met"
    lacking = json.dumps([{"scenario": "ramp", "startup_s": 60.0, "policy": "ours", "gpu_hours": 1.0}])
    for bad, why in (
        ("{not json", "Expecting"),
        ('{"a": 1}', "not a list of rows"),
        (lacking, "a row without a usable 'goodput_pct'"),
    ):
        saved.write_text(bad)
        done = _bench("--check", str(saved))
        assert done.returncode == 2 and why in done.stderr and done.stdout == ""
    done = _bench("--check", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "missing.json" in done.stderr
