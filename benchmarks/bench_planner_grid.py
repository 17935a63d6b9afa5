"""Planner settings against the outcome targets: every point of a grid of config values, on every scenario.

For each combination of the ``--grid`` values it runs our planner on the scenario suite at each cold
start, and judges the runs with ``dynamo.planner.sim.acceptance`` against the same static fleets and
upstream runs as ``bench_planner_outcomes.py`` (cached there, searched or run once if missing). Prints
one line per point: how many targets it meets and which it misses; ``--json`` writes every run. The
knobs that trade GPU-hours for goodput (default grid) show where the targets conflict. ``--seeds 0,1,2``
judges every point on each seed's traces (each against its own baselines): a setting chosen on one seed
can turn on a few requests.

    python benchmarks/bench_planner_grid.py [--grid 'headroom_sigmas=1,2,3'] [--grid 'forecast.enabled=false']
        [--scenarios a,b] [--startups 0,60] [--config BASE] [--no-upstream] [--jobs N] [--json PATH]
        [--seeds 0,1,2]
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

from bench_planner_outcomes import CACHE, load_cache, parse_seeds, static_baseline, upstream_baseline
from dynamo.planner.config import ConfigError, config_from_mapping, load_config_arg, merge
from dynamo.planner.sim.acceptance import Check, check
from dynamo.planner.sim.harness import at_startup, trace_spec
from dynamo.planner.sim.runs import SUITE_FLEET_LIMITS, planner_row
from dynamo.planner.sim.scenarios import SCENARIOS, scenario_names, write_trace
from upstream_planner.client import available as upstream_available

DEFAULT_GRID = (
    "headroom_sigmas=1,2,3",
    "scale_down_stabilization_s=120,300",
    "forecast.enabled=true,false",
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
    return "; ".join(
        ("" if c.seed is None else f"seed {c.seed} ")
        + f"{c.scenario} {c.startup_s:g}s {c.criterion} {c.measured}"
        for c in checks
        if not c.met
    )


def _per_seed(checks: list[Check], seeds: list[int]) -> str:
    """`` (seed 0: 58, seed 1: 57)`` with several seeds, else nothing."""
    if len(seeds) < 2:
        return ""
    return " (" + ", ".join(f"seed {s}: {sum(c.met for c in checks if c.seed == s)}" for s in seeds) + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--grid", action="append", help=f"key=v1,v2,... (repeatable; default: {'; '.join(DEFAULT_GRID)})"
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names (default: all)")
    ap.add_argument(
        "--startups", default="0,60", help="cold starts in seconds (default: 0,60, where targets are)"
    )
    ap.add_argument(
        "--seeds",
        default=None,
        help="the traces' seeds, comma-separated: every point runs on each (default: 0)",
    )
    ap.add_argument("--seed", type=int, default=None, help="one seed: the same as --seeds N")
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
        seeds = parse_seeds(args.seeds, args.seed)
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
    traces: dict[tuple[int, str], str] = {}
    for seed in seeds:
        for name in names:
            trace = write_trace(name, CACHE / f"{name}-{seed}.jsonl", seed=seed)
            traces[(seed, name)] = str(trace)
            spec0 = trace_spec(trace, SCENARIOS[name].initial, 0.0, args.sla_ttft_ms, args.sla_itl_ms)
            found = static_baseline(trace, spec0, cache, cache_file)
            if found:
                policy = f"static {found[0]}+{found[0]}"
                baselines.append(
                    {"scenario": name, "startup_s": None, "policy": policy, **found[1], "seed": seed}
                )
            for startup in startups if not upstream_reason else ():
                up = upstream_baseline(name, trace, at_startup(spec0, startup), startup, cache, cache_file)
                if up is not None:
                    baselines.append(
                        {
                            "scenario": name,
                            "startup_s": startup,
                            "policy": "upstream-1.6.1",
                            **up,
                            "seed": seed,
                        }
                    )
    print(
        f"{len(points)} points x {len(names)} scenarios x {len(startups)} cold starts x {len(seeds)} seeds, "
        f"{args.jobs} jobs",
        flush=True,
    )
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for i, point in enumerate(points, 1):
            cfg = point_config(base, point)
            jobs = [
                (seed, (n, st, traces[(seed, n)], cfg, args.sla_ttft_ms, args.sla_itl_ms))
                for seed in seeds
                for n in names
                for st in startups
            ]
            futures = [(seed, pool.submit(planner_row, *job)) for seed, job in jobs]
            runs = [{**f.result(), "seed": seed} for seed, f in futures]
            checks = check(baselines + runs)
            met = sum(c.met for c in checks)
            print(
                f"[{i}/{len(points)} {time.perf_counter() - t0:.0f} s] {_label(point)}: "
                f"{met} of {len(checks)} met{_per_seed(checks, seeds)}; missed: {_missed(checks) or 'none'}",
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
