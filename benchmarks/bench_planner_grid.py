"""Planner settings against the outcome targets: every point of a grid of config values, on every scenario.

For each combination of the ``--grid`` values it runs our planner on the scenario suite at each cold
start, and judges the runs with ``dynamo.planner.sim.acceptance`` against the same static fleets and
upstream runs as ``bench_planner_outcomes.py`` (cached there, searched or run once if missing). Prints
one line per point: how many targets it meets and which it misses; ``--json`` writes every run. The
knobs that trade GPU-hours for goodput (default grid) show where the targets conflict.

    python benchmarks/bench_planner_grid.py [--grid 'projection_cap=1,1.5,2'] [--grid 'decode_trend=held']
        [--scenarios a,b] [--startups 0,60] [--config BASE] [--no-upstream] [--jobs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench_planner_outcomes import CACHE, load_cache, static_baseline, upstream_baseline
from dynamo.planner.config import ConfigError, config_from_mapping, load_config_arg, merge
from dynamo.planner.sim.acceptance import Check, check
from dynamo.planner.sim.harness import at_startup, trace_spec
from dynamo.planner.sim.runs import SUITE_FLEET_LIMITS, planner_row
from dynamo.planner.sim.scenarios import SCENARIOS, scenario_names, write_trace
from upstream_planner.client import available as upstream_available

DEFAULT_GRID = (
    "projection_cap=1,1.5,2",
    "scale_down_stabilization_s=180,300",
    "decode_trend=demand,held",
)


def parse_axis(text: str) -> tuple[str, list[Any]]:
    """``key=v1,v2`` (a dotted key nests: ``decode.max_replicas=8,16``); values read as JSON, else text."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ValueError(f"--grid {text!r}: expected key=value,value")
    out: list[Any] = []
    for v in values.split(","):
        try:
            out.append(json.loads(v))
        except ValueError:
            out.append(v.strip())
    return key.strip(), out


def _nested(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


def point_config(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    cfg = merge(SUITE_FLEET_LIMITS, base)
    for key, value in point.items():
        cfg = merge(cfg, _nested(key, value))
    return cfg


def _label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in point.items())


def _missed(checks: list[Check]) -> str:
    return "; ".join(f"{c.scenario} {c.startup_s:g}s {c.criterion} {c.measured}" for c in checks if not c.met)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--grid", action="append", help=f"key=v1,v2,... (repeatable; default: {'; '.join(DEFAULT_GRID)})"
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names (default: all)")
    ap.add_argument(
        "--startups", default="0,60", help="cold starts in seconds (default: 0,60, where targets are)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sla-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--sla-itl-ms", type=float, default=50.0)
    ap.add_argument("--config", help="the base config (file or inline) every point is merged over")
    ap.add_argument("--no-upstream", action="store_true", help="no 'goodput >= upstream' targets")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations in parallel")
    ap.add_argument("--json", help="write every point's runs and verdicts to this file")
    args = ap.parse_args()
    try:
        names = scenario_names(args.scenarios)
        try:
            startups = [float(x) for x in args.startups.split(",")]
        except ValueError:
            raise ValueError(f"--startups {args.startups!r}: expected seconds, comma-separated") from None
        axes = [parse_axis(a) for a in (args.grid or DEFAULT_GRID)]
        base = load_config_arg(args.config)
        points = [
            dict(zip([k for k, _ in axes], combo, strict=True))
            for combo in itertools.product(*(v for _, v in axes))
        ]
        for point in points:  # every point is a valid config before an hour of simulation starts
            config_from_mapping(point_config(base, point))
    except (ValueError, ConfigError) as exc:
        print(f"bench_planner_grid: {exc}", file=sys.stderr)
        return 2
    upstream_reason = "--no-upstream" if args.no_upstream else upstream_available()
    if upstream_reason:
        print(f"upstream planner skipped: {upstream_reason}", file=sys.stderr)
    cache, cache_file = load_cache()
    baselines: list[dict[str, Any]] = []
    traces: dict[str, str] = {}
    for name in names:
        trace = write_trace(name, CACHE / f"{name}-{args.seed}.jsonl", seed=args.seed)
        traces[name] = str(trace)
        spec0 = trace_spec(trace, SCENARIOS[name].initial, 0.0, args.sla_ttft_ms, args.sla_itl_ms)
        found = static_baseline(trace, spec0, cache, cache_file)
        if found:
            baselines.append(
                {"scenario": name, "startup_s": None, "policy": f"static {found[0]}+{found[0]}", **found[1]}
            )
        for startup in startups if not upstream_reason else ():
            up = upstream_baseline(name, trace, at_startup(spec0, startup), startup, cache, cache_file)
            if up is not None:
                baselines.append({"scenario": name, "startup_s": startup, "policy": "upstream-1.6.1", **up})
    print(
        f"{len(points)} points x {len(names)} scenarios x {len(startups)} cold starts, {args.jobs} jobs",
        flush=True,
    )
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for i, point in enumerate(points, 1):
            cfg = point_config(base, point)
            jobs = [
                (n, st, traces[n], cfg, args.sla_ttft_ms, args.sla_itl_ms) for n in names for st in startups
            ]
            runs = [f.result() for f in [pool.submit(planner_row, *job) for job in jobs]]
            checks = check(baselines + runs)
            met = sum(c.met for c in checks)
            print(
                f"[{i}/{len(points)} {time.perf_counter() - t0:.0f} s] {_label(point)}: "
                f"{met} of {len(checks)} met; missed: {_missed(checks) or 'none'}",
                flush=True,
            )
            out.append(
                {
                    "point": point,
                    "met": met,
                    "targets": len(checks),
                    "runs": runs,
                    "missed": [c.__dict__ for c in checks if not c.met],
                }
            )
    # Ties go to the point with the fewest GPU-hours over all its runs.
    best = max(out, key=lambda r: (r["met"], -sum(x["gpu_hours"] for x in r["runs"]))) if out else None
    if best is not None:
        print(f"most targets met: {_label(best['point'])} ({best['met']} of {best['targets']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"baselines": baselines, "points": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
