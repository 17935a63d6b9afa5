"""What each scenario allows: scripted right-sized fleets, reactive and clairvoyant, per cold start.

For every phased scenario of ``dynamo.planner.sim.scenarios`` it measures each phase's need on its own
(``dynamo.planner.sim.frontier.phase_needs``: cheapest prefill and decode counts reaching the goodput
target on that phase's requests, fleet ready from the start), then replays the whole trace with a fleet
scripted from those needs: **reactive** (grows 5 s after a phase begins) and **clairvoyant** (grows one
cold start before it). The planner is judged against these, not against 100% (docs/planner-evaluation.md).
The slow wave (one continuous phase) and the fleet scale (its phase searches take ~15 minutes) are left out.

    python benchmarks/bench_planner_frontier.py [--scenarios a,b] [--startups 0,60] [--need-pct 99]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynamo.planner.sim.frontier import frontier, phase_needs
from dynamo.planner.sim.harness import at_startup, trace_spec
from dynamo.planner.sim.scenarios import SCENARIOS, scenario_names, write_trace

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-planner-outcomes"
DEFAULT = "decode-shift,prompt-burst,ramp,idle-gap,flash-crowd,opposite-shift"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=DEFAULT, help=f"comma-separated names (default: {DEFAULT})")
    ap.add_argument("--startups", default="0,60", help="cold starts in seconds (default: 0,60)")
    ap.add_argument("--need-pct", type=float, default=99.0, help="goodput a phase's need must reach (99)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every summary to this file")
    args = ap.parse_args()
    try:
        names = scenario_names(args.scenarios)
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
        needs = phase_needs(sc, base, seed=args.seed, target_pct=args.need_pct)
        shown = " ".join(f"{n.start_s:g}:{n.prefill}+{n.decode}" for n in needs)
        print(f"  [{name}: phase needs in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
        for startup in (float(x) for x in args.startups.split(",")):
            for fleet, s in frontier(sc, at_startup(base, startup), needs).items():
                print(
                    f"{name:<15} {startup:>5g}  {fleet:<12} {s['goodput_pct']:>7.1f}% "
                    f"{s['gpu_hours']:>7.3f}   {shown}",
                    flush=True,
                )
                results.append({"scenario": name, "startup_s": startup, "fleet": fleet, **s})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
