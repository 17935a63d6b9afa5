"""What each scenario allows: scripted right-sized fleets, reactive and clairvoyant, per cold start.

For every phased scenario of ``dynamo.planner.sim.scenarios`` it measures each phase's need on its own
(``dynamo.planner.sim.frontier.phase_needs``: cheapest prefill and decode counts reaching the goodput
target on that phase's requests, fleet ready from the start), then replays the whole trace with a fleet
scripted from those needs: **reactive** (grows 5 s after a phase begins) and **clairvoyant** (grows one
cold start before it). The planner is judged against these, not against 100% (docs/planner-evaluation.md).
The slow wave (one continuous phase) and the fleet scale are left out by default (its phase searches take
8-15 minutes and need ``--ample 64``).

With ``--overshoot`` it also runs the reactive fleet with extra replicas on each pool that grows, held for
a while after the ask (``dynamo.planner.sim.frontier.overshoot_script``), over a grid of (extra, hold),
and prints the points no other beats on both goodput and GPU-hours: what a reactive planner that knew
each phase's need could buy for its GPU-hours.

    python benchmarks/bench_planner_frontier.py [--scenarios a,b] [--startups 0,60] [--need-pct 99] \
        [--overshoot] [--extras 1,2,3,4,5,6] [--holds 30,60,120,180,240] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dynamo.planner.sim.frontier import AMPLE, frontier, overshoot_frontier, pareto_front, phase_needs
from dynamo.planner.sim.harness import at_startup, trace_spec
from dynamo.planner.sim.scenarios import SCENARIOS, scenario_names, write_trace

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-planner-outcomes"
T = TypeVar("T", int, float)
DEFAULT = "decode-shift,prompt-burst,ramp,idle-gap,flash-crowd,opposite-shift"


def _row(name: str, startup: float, fleet: str, s: dict[str, Any], tail: str) -> None:
    print(
        f"{name:<15} {startup:>5g}  {fleet:<12} {s['goodput_pct']:>7.1f}% {s['gpu_hours']:>7.3f}   {tail}",
        flush=True,
    )


def _grid(flag: str, text: str, kind: Callable[[str], T], least: float) -> list[T]:
    """A comma-separated list of numbers of ``kind``, each at least ``least``; ValueError naming the flag."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(float(v) < least for v in values):
        what = "whole numbers >= 1" if kind is int else "seconds > 0"
        raise ValueError(f"{flag}: expected comma-separated {what}, got {text!r}")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=DEFAULT, help=f"comma-separated names (default: {DEFAULT})")
    ap.add_argument("--startups", default="0,60", help="cold starts in seconds (default: 0,60)")
    ap.add_argument("--need-pct", type=float, default=99.0, help="goodput a phase's need must reach (99)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ample",
        type=int,
        default=AMPLE,
        help=f"the other pool's replicas while one pool's need is searched ({AMPLE}; fleet scale: 64)",
    )
    ap.add_argument("--overshoot", action="store_true", help="also the reactive fleet with extra replicas")
    ap.add_argument("--extras", default="1,2,3,4,5,6", help="--overshoot: extra replicas (default: 1,...,6)")
    ap.add_argument(
        "--holds", default="30,60,120,180,240", help="--overshoot: seconds held (default: 30,60,120,180,240)"
    )
    ap.add_argument("--json", help="write every summary to this file")
    args = ap.parse_args()
    try:
        names = scenario_names(args.scenarios)
        extras = _grid("--extras", args.extras, int, 1)
        holds = _grid("--holds", args.holds, float, 1e-9)
        if args.ample < 1:
            raise ValueError(f"--ample: expected a whole number >= 1, got {args.ample}")
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    results = []
    print(
        f"{'scenario':<15} {'start':>5}  {'fleet':<12} {'goodput':>8} {'GPU-h':>7}   "
        "phase needs (start s: P+D)"
    )
    for name in names:
        sc = SCENARIOS[name]
        trace = write_trace(name, CACHE / f"{name}-{args.seed}.jsonl", seed=args.seed)
        base = trace_spec(trace, sc.initial)
        t0 = time.perf_counter()
        needs = phase_needs(sc, base, seed=args.seed, target_pct=args.need_pct, ample=args.ample)
        shown = " ".join(f"{n.start_s:g}:{n.prefill}+{n.decode}" for n in needs)
        print(f"  [{name}: phase needs in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
        for startup in (float(x) for x in args.startups.split(",")):
            for fleet, s in frontier(sc, at_startup(base, startup), needs).items():
                _row(name, startup, fleet, s, shown)
                results.append({"scenario": name, "startup_s": startup, "fleet": fleet, **s})
            if not args.overshoot:
                continue
            t0 = time.perf_counter()

            def tell(done: int, total: int, name: str = name, startup: float = startup) -> None:
                print(
                    f"  [{name} {startup:g} s: overshoot fleet {done} of {total}]",
                    file=sys.stderr,
                    flush=True,
                )

            grid = overshoot_frontier(at_startup(base, startup), needs, extras, holds, progress=tell)
            print(
                f"  [{name} {startup:g} s: {len(grid)} overshoot fleets in {time.perf_counter() - t0:.0f} s]",
                file=sys.stderr,
            )
            for s in pareto_front(grid, lambda r: r["goodput_pct"], lambda r: r["gpu_hours"]):
                fleet = f"+{s['extra']} for {s['hold_s']:g}s" if s["extra"] else "reactive"
                _row(name, startup, fleet, s, "(overshoot front)")
            results.extend({"scenario": name, "startup_s": startup, "fleet": "overshoot", **s} for s in grid)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
