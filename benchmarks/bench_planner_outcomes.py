"""Planner outcomes on Dynamo's fleet simulator: SLA goodput and GPU-hours per scenario and cold start.

For every scenario of ``dynamo.planner.sim.scenarios`` (seeded traces) and cold start, it runs our
planner (``python -m dynamo.planner simulate``'s harness), upstream Dynamo 1.6.1's load-based planner
(isolated environment: ``make upstream-planner-env``; it uses import-only stand-ins for aisimulate,
which load-based scaling does not call) and finds the cheapest static N+N fleet reaching 95% goodput.
Prints one row per (scenario, cold start, policy); ``--json`` writes every summary. Our planner's runs go to
``--jobs`` worker processes while the main process searches the static fleets and runs upstream's planner.
``--seeds 0,1,2`` runs the suite on each seed's traces (each judged against its own static fleet and
upstream run) and says how many seeds meet each target.

    python benchmarks/bench_planner_outcomes.py [--scenarios a,b] [--startups 0,60,180] [--no-upstream] \
        [--jobs N] [--seeds 0,1,2] [--router kv]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dynamo.planner.config import ConfigError, config_from_mapping, load_config_arg, merge
from dynamo.planner.sim.acceptance import check, report
from dynamo.planner.sim.baselines import cheapest_static
from dynamo.planner.sim.harness import ROUTERS, SimSpec, at_startup, trace_spec
from dynamo.planner.sim.runs import SUITE_FLEET_LIMITS, planner_row
from dynamo.planner.sim.scenarios import SCENARIOS, scenario_names, write_trace
from upstream_planner.client import available as upstream_available
from upstream_planner.client import run_upstream

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-planner-outcomes"
UPSTREAM_CONFIG = {"max_gpu_budget": 128}
HEADER = (
    f"{'scenario':<15} {'start':>5}  {'policy':<16} {'goodput':>8} {'GPU-h':>7} {'xstatic':>7} "
    f"{'p90 TTFT':>9} {'p90 ITL':>8} {'actions':>7} {'flips':>5} {'planner s':>9} {'sim s':>7}"
)


def row(scenario: str, start: str, policy: str, s: dict[str, Any], static_gpu_h: float | None) -> str:
    ratio = f"{s['gpu_hours'] / static_gpu_h:.2f}" if static_gpu_h else "-"
    ttft = "-" if s.get("p90_ttft_ms") is None else f"{s['p90_ttft_ms']:.0f}"
    itl = "-" if s.get("p90_itl_ms") is None else f"{s['p90_itl_ms']:.1f}"
    return (
        f"{scenario:<15} {start:>5}  {policy:<16} {s['goodput_pct']:>7.1f}% {s['gpu_hours']:>7.3f} "
        f"{ratio:>7} "
        f"{ttft:>9} {itl:>8} {s.get('scaling_actions', 0):>7} {s.get('direction_flips', 0):>5} "
        f"{s.get('planner_wall_s', 0.0):>9.2f} {s.get('simulator_wall_s', s.get('wall_s', 0.0)):>7.2f}"
    )


def _key(trace: Path, spec: SimSpec) -> str:
    h = hashlib.sha1(trace.read_bytes())
    h.update(
        json.dumps(
            [spec.prefill_engine_args, spec.decode_engine_args, spec.sla_ttft_ms, spec.sla_itl_ms]
        ).encode()
    )
    h.update(json.dumps(UPSTREAM_CONFIG).encode())
    if spec.router != "round-robin":  # keys cached before the router option stay valid
        h.update(spec.router.encode())
    return h.hexdigest()[:16]


def _save(path: Path, cache: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))


def load_cache() -> tuple[dict[str, Any], Path]:
    """The cached static fleets and upstream runs (neither depends on our planner), and their file."""
    cache_file = CACHE / "baselines.json"
    cache: dict[str, Any] = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    old = CACHE / "upstream.json"  # before static fleets were cached too
    if old.exists() and not cache:
        cache = json.loads(old.read_text())
    return cache, cache_file


def static_baseline(
    trace: Path, base: SimSpec, cache: dict[str, Any], cache_file: Path
) -> tuple[int, dict[str, Any]] | None:
    """The cheapest static N+N fleet reaching 95% on this trace (searched once, then cached; the search
    starts from the scenario's starting fleet, which skips the slow overloaded small fleets)."""
    skey = f"static-{_key(trace, base)}"
    if skey not in cache:  # a static fleet's outcome does not depend on the planner: cached
        hit = cheapest_static(base, start=max(base.initial))
        cache[skey] = None if hit is None else [hit[0], hit[1]]
        _save(cache_file, cache)
    found = cache[skey]
    return None if found is None else (int(found[0]), found[1])


def upstream_baseline(
    name: str, trace: Path, spec: SimSpec, startup: float, cache: dict[str, Any], cache_file: Path
) -> dict[str, Any] | None:
    """Upstream's planner on this trace and cold start (run once, then cached); None if it failed."""
    key = f"{_key(trace, spec)}-{startup:g}" + (
        "" if spec.initial == (1, 1) else f"-{spec.initial[0]},{spec.initial[1]}"
    )
    if key not in cache:
        t1 = time.perf_counter()
        try:
            cache[key] = run_upstream(
                [trace],
                spec.prefill_engine_args,
                spec.decode_engine_args,
                startup_time_s=startup,
                sla_ttft_ms=spec.sla_ttft_ms,
                sla_itl_ms=spec.sla_itl_ms,
                initial=spec.initial,
                planner_config=UPSTREAM_CONFIG,
            )
        except RuntimeError as exc:
            print(f"  [{name} {startup:g} s: upstream failed: {str(exc).splitlines()[0]}]", file=sys.stderr)
            return None
        print(f"  [{name} {startup:g} s: upstream {time.perf_counter() - t1:.0f} s]", file=sys.stderr)
        _save(cache_file, cache)
    result: dict[str, Any] = cache[key]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names (default: all)")
    ap.add_argument("--startups", default="0,60,180", help="cold starts in seconds (default: 0,60,180)")
    ap.add_argument(
        "--seeds",
        default=None,
        help="the traces' seeds, comma-separated: the suite runs on each (default: 0)",
    )
    ap.add_argument("--seed", type=int, default=None, help="one seed: the same as --seeds N")
    ap.add_argument("--sla-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--sla-itl-ms", type=float, default=50.0)
    ap.add_argument("--config", help="our planner's config (file or inline), merged over the fleet limits")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's planner")
    ap.add_argument(
        "--router",
        choices=list(ROUTERS),
        default="round-robin",
        help="the simulated router for ours and the static fleets (upstream's runs: round-robin only)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="our planner's runs in parallel (default: cores)",
    )
    ap.add_argument("--json", help="write every summary to this file")
    ap.add_argument(
        "--check",
        metavar="FILE",
        help="run nothing: judge a file written by --json against the targets (docs/planner-evaluation.md)",
    )
    args = ap.parse_args()
    if args.check:
        return _check_file(Path(args.check))
    try:
        names = scenario_names(args.scenarios)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"--jobs {args.jobs}: expected 1 or more", file=sys.stderr)
        return 2
    try:
        startups = [float(x) for x in args.startups.split(",")]
    except ValueError:
        print(f"--startups {args.startups!r}: expected seconds, comma-separated", file=sys.stderr)
        return 2
    try:
        seeds = parse_seeds(args.seeds, args.seed)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        mapping = merge(SUITE_FLEET_LIMITS, load_config_arg(args.config))
        config_from_mapping(mapping)  # a bad config fails here, before any simulation
    except (ValueError, ConfigError) as exc:
        print(f"--config: {exc}", file=sys.stderr)
        return 2
    upstream_reason = "--no-upstream" if args.no_upstream else upstream_available()
    if not upstream_reason and args.router != "round-robin":
        upstream_reason = f"--router {args.router}: upstream's replay here is round-robin only"

    if upstream_reason:
        print(f"upstream planner skipped: {upstream_reason}", file=sys.stderr)
    cache, cache_file = load_cache()
    results: list[dict[str, Any]] = []
    traces = {
        (seed, n): write_trace(n, CACHE / f"{n}-{seed}.jsonl", seed=seed) for seed in seeds for n in names
    }
    pool = ProcessPoolExecutor(max_workers=args.jobs)
    # Every run of ours starts now; the loop below prints them in order as the baselines come.
    ours_runs: dict[tuple[int, str, float], Future[dict[str, Any]]] = {
        (seed, n, st): pool.submit(
            planner_row,
            n,
            st,
            str(traces[(seed, n)]),
            mapping,
            args.sla_ttft_ms,
            args.sla_itl_ms,
            args.router,
        )
        for seed in seeds
        for n in names
        for st in startups
    }
    print(HEADER)
    try:
        for seed in seeds:
            if len(seeds) > 1:
                print(f"seed {seed}", flush=True)
            rows = _report_rows(
                seed, names, startups, traces, ours_runs, upstream_reason, cache, cache_file, args
            )
            results.extend(rows)
    finally:
        pool.shutdown(cancel_futures=True)
    if not upstream_reason:
        print(
            "* upstream Dynamo 1.6.1's load-based planner; aisimulate replaced by import-only stand-ins "
            "(unused)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    print(report(check(results)))
    return 0


def parse_seeds(listed: str | None, one: int | None) -> list[int]:
    """The seeds ``--seeds`` / ``--seed`` ask for (default: 0); ValueError saying what is wrong."""
    if listed is not None and one is not None:
        raise ValueError("--seed and --seeds: give one of them")
    if listed is None:
        return [0 if one is None else one]
    try:
        seeds = [int(x) for x in listed.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {listed!r}: expected integers, comma-separated") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {listed!r}: a seed is listed twice")
    return seeds


def _report_rows(
    seed: int,
    names: list[str],
    startups: list[float],
    traces: dict[tuple[int, str], Path],
    ours_runs: dict[tuple[int, str, float], Future[dict[str, Any]]],
    upstream_reason: str | None,
    cache: dict[str, Any],
    cache_file: Path,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Per scenario: its static fleet, then ours and upstream's at each cold start, printed as they come.

    Returns the rows, each with its ``seed``."""
    results: list[dict[str, Any]] = []
    for name in names:
        trace = traces[(seed, name)]
        base = trace_spec(trace, SCENARIOS[name].initial, 0.0, args.sla_ttft_ms, args.sla_itl_ms, args.router)
        t0 = time.perf_counter()
        found = static_baseline(trace, base, cache, cache_file)
        static_gpu_h = found[1]["gpu_hours"] if found else None
        print(f"  [{name} seed {seed}: static search {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
        if found:
            n, s = found
            print(row(name, "-", f"static {n}+{n}", s, static_gpu_h))
            results.append(
                {"scenario": name, "startup_s": None, "policy": f"static {n}+{n}", **s, "seed": seed}
            )
        else:
            print(f"{name:<15} {'-':>5}  no static fleet up to 128+128 reaches 95%")
        for startup in startups:
            ours = ours_runs[(seed, name, startup)].result()
            print(row(name, f"{startup:g}", "ours", ours, static_gpu_h), flush=True)
            results.append({**ours, "seed": seed})
            if upstream_reason:
                continue
            up = upstream_baseline(name, trace, at_startup(base, startup), startup, cache, cache_file)
            if up is None:
                continue
            print(row(name, f"{startup:g}", "upstream 1.6.1*", up, static_gpu_h), flush=True)
            results.append(
                {"scenario": name, "startup_s": startup, "policy": "upstream-1.6.1", **up, "seed": seed}
            )
    return results


def _check_file(path: Path) -> int:
    """The targets' verdict on a saved run; 2 on a file that is not one."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"--check {path}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "scenario" in r for r in rows):
        print(f"--check {path}: not a list of rows written by --json", file=sys.stderr)
        return 2
    try:
        checks = check(rows)
    except (KeyError, TypeError, ValueError) as exc:
        print(f"--check {path}: a row without a usable {exc}", file=sys.stderr)
        return 2
    print(report(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
