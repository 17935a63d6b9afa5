"""The planner on production-like traffic: the Azure 2023 traces (x1, x2, x4) and the generated families.

For every workload of ``dynamo.planner.sim.workloads`` asked for (and every ``--trace``: another production
trace, say, in Azure's or BurstGPT's CSV or Mooncake's JSON lines, cut by ``--trace-window`` and run at each
of ``--trace-speedups`` under its file's name) and every router, it searches the cheapest
static P+D fleet reaching 95% (each pool on its own; cached under ``.cache/``), then runs our planner from
that fleet at each cold start and from 1+1 at 0 s. Prints one row per run: goodput, GPU-hours as a ratio to
the static fleet's, changes of direction per pool per 30 minutes, and the issue's targets (YES/NO). A second
table sets each 0 s run from the need against the cheapest static fleet reaching that run's own goodput.
Dynamo's KV router breaks ties at random, so a KV-routed run is one draw: ``--repeat N`` runs each N times,
prints the median run (by GPU-hours) and the spread under it, and keeps every run in ``--json``. Searches and
planner runs go to ``--jobs`` worker processes; progress lines go to stderr.

    python benchmarks/bench_planner_traffic.py [--workloads azure-conv-x1,...] [--trace FILE ...] \
        [--trace-window START:LENGTH] [--trace-speedups 1,2,4] [--routers round-robin,kv] [--startups 0,60] \
        [--repeat N] [--jobs N] [--config FILE] [--json FILE]
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
from dynamo.planner.sim.harness import ROUTERS
from dynamo.planner.sim.inputs import SimInputError
from dynamo.planner.sim.prefixes import BLOCK_TOKENS, DEFAULT_SHARE
from dynamo.planner.sim.runs import SUITE_FLEET_LIMITS, workload_row, workload_spec, workload_static
from dynamo.planner.sim.trace_files import LONG_REPLAY, TraceOptions, prepare_trace
from dynamo.planner.sim.trace_rows import parse_window
from dynamo.planner.sim.traffic_targets import Verdict, judge
from dynamo.planner.sim.workloads import WORKLOADS, write_workload

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-planner-traffic"
# The table: each trace at x1, x2 and x4 (x8 and x16 and the generated families by --workloads).
AZURE = [f"azure-{trace}-x{speed}" for trace in ("conv", "code") for speed in (1, 2, 4)]
NAME_WIDTH = [15]  # the workload column's width: the longest name's, set once by ``main``


def header() -> str:
    w = NAME_WIDTH[0]
    return (
        f"{'workload':<{w}} {'router':<11} {'from':<6} {'start':>5}  {'goodput':>8} {'GPU-h':>7} "
        f"{'xstatic':>7} "
        f"{'flips/30m P,D':>13} {'p90 TTFT':>8} {'reuse':>6}  {'goodput':>7} {'GPU-h':>5} {'flips':>5}"
    )


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("YES" if ok else "NO")


def row(name: str, router: str, start: str, cold: str, s: dict[str, Any], static_gpu_h: float | None) -> str:
    """One printed row; the last three columns are the issue's targets for a planner run."""
    ratio = f"{s['gpu_hours'] / static_gpu_h:.2f}" if static_gpu_h else "-"
    ttft = "-" if s.get("p90_ttft_ms") is None else f"{s['p90_ttft_ms']:.0f}"
    head = (
        f"{name:<{NAME_WIDTH[0]}} {router:<11} {start:<6} {cold:>5}  {s['goodput_pct']:>7.1f}% "
        f"{s['gpu_hours']:>7.3f} {ratio:>7} "
    )
    if s.get("mode") == "static":
        return head + f"{'':>13} {ttft:>8} {s.get('prefix_cache_reused_pct', 0.0):>5.1f}%"
    v = judge(s, float(s["startup_s"]), start == "1+1", static_gpu_h)
    flips = f"{v.flips_per_30_min['prefill']:.1f},{v.flips_per_30_min['decode']:.1f}"
    return head + (
        f"{flips:>13} {ttft:>8} {s.get('prefix_cache_reused_pct', 0.0):>5.1f}%  "
        f"{_yes(v.goodput_ok):>7} {_yes(v.gpu_hours_ok):>5} {_yes(v.flips_ok):>5}"
    )


def _key(trace: Path, router: str, block_size: int = BLOCK_TOKENS) -> str:
    h = hashlib.sha1(trace.read_bytes())
    spec = workload_spec(trace, (1, 1), 0.0, router, block_size)
    h.update(json.dumps([spec.prefill_engine_args, spec.decode_engine_args, spec.sla_ttft_ms]).encode())
    h.update(json.dumps([spec.sla_itl_ms, router, spec.trace_block_size]).encode())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workloads",
        help="comma-separated (default: the Azure traces at x1, x2, x4; none when --trace is given)",
    )
    ap.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a trace run as a workload of its own, named after its file (repeatable): Mooncake JSON lines "
        "replayed as they are, or a CSV in Azure's format (TIMESTAMP,ContextTokens,GeneratedTokens) or "
        "BurstGPT's (Timestamp,Request tokens,Response tokens,...) with the prefix sharing modelled as for "
        "the Azure workloads; on the workloads' engines and SLA, its static search from 1+1",
    )
    ap.add_argument(
        "--trace-window",
        metavar="START:LENGTH",
        help="--trace: replay only this part, in the trace's own time from its first request (2h:1h is the "
        "third hour; units s, m, h, d; START: to the end; LENGTH alone from the start)",
    )
    ap.add_argument(
        "--trace-speedups",
        default="1",
        metavar="F,...",
        help="--trace: each trace replayed at each of these speed-ups, as the Azure workloads' x1, x2, x4 "
        "(a row named FILE-x2 for 2) (default: 1)",
    )
    ap.add_argument(
        "--trace-block-size",
        type=int,
        metavar="N",
        help=f"prompt tokens each hash id of a Mooncake --trace stands for (default: read from the trace, "
        f"the size every request's ids agree with, else {BLOCK_TOKENS}; Mooncake's published traces hash "
        f"512-token blocks, the traces written here 64)",
    )
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated (default: round-robin,kv)")
    ap.add_argument("--startups", default="0,60", help="cold starts in seconds (default: 0,60)")
    ap.add_argument("--seed", type=int, default=0, help="the prefix sharing's (and generators') seed")
    ap.add_argument(
        "--prefix-share",
        type=float,
        default=DEFAULT_SHARE,
        help=f"the share of requests continuing an earlier one, on the Azure workloads and CSV --trace "
        f"files (default: {DEFAULT_SHARE:g})",
    )
    ap.add_argument("--config", help="our planner's config (file or inline), merged over the fleet limits")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="runs of each KV-routed planner row: the median is printed with the spread (default: 1; "
        "round-robin runs repeat to the digit and run once)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs in parallel (default: cores)")
    ap.add_argument("--json", help="write every row to this file")
    ap.add_argument(
        "--cache",
        type=Path,
        default=CACHE,
        metavar="DIR",
        help="the workloads' traces and static searches (default: .cache/bench-planner-traffic)",
    )
    args = ap.parse_args()
    cache_dir: Path = args.cache
    workloads = args.workloads if args.workloads is not None else ("" if args.trace else ",".join(AZURE))
    names = [n.strip() for n in workloads.split(",") if n.strip()]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [n for n in names if n not in WORKLOADS] + [r for r in routers if r not in ROUTERS]
    block_size = args.trace_block_size
    if bad or args.jobs < 1 or args.repeat < 1 or (block_size is not None and block_size < 1):
        what = "--jobs" if args.jobs < 1 else "--repeat" if args.repeat < 1 else "--trace-block-size"
        print(f"unknown workload or router {bad[0]!r}" if bad else f"{what}: 1 or more", file=sys.stderr)
        return 2
    if not 0 <= args.prefix_share <= 1:
        print(f"--prefix-share {args.prefix_share:g}: expected 0 to 1", file=sys.stderr)
        return 2
    given: dict[str, Path] = {}
    block_of: dict[str, int] = {}
    try:
        window = parse_window(args.trace_window) if args.trace_window is not None else None
        speedups = [float(x) for x in args.trace_speedups.split(",") if x.strip()]
        for file in args.trace:
            for speedup in speedups:
                name = Path(file).stem + ("" if speedup == 1 else f"-x{speedup:g}")
                if name in WORKLOADS or name in given:
                    print(f"--trace {file}: the name {name!r} is taken; rename the file", file=sys.stderr)
                    return 2
                # A whole week is hours per run: the table's runs (about 10 per router) need a window.
                most = LONG_REPLAY if window is None else None
                opts = TraceOptions(window, speedup, args.prefix_share, args.seed, block_size, most)
                given[name], block_of[name] = _replayable(file, name, opts, cache_dir)
    except SimInputError as exc:
        print(f"--trace: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"--trace-speedups {args.trace_speedups!r}: {exc}", file=sys.stderr)
        return 2
    NAME_WIDTH[0] = max([15, *(len(n) for n in [*names, *given])])
    try:
        startups = [float(x) for x in args.startups.split(",")]
        mapping = merge(SUITE_FLEET_LIMITS, load_config_arg(args.config))
        config_from_mapping(mapping)  # a bad config fails here, before any simulation
    except (ValueError, ConfigError) as exc:
        print(f"bad argument: {exc}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    traces = {
        n: write_workload(
            n, cache_dir / f"{n}-{args.seed}-{args.prefix_share:g}.jsonl", args.seed, args.prefix_share
        )
        for n in names
    }
    traces.update(given)
    names += list(given)
    # Prompt tokens per hash id: 64 in every trace written here (workloads, Azure CSVs), a Mooncake
    # --trace's --trace-block-size.
    blocks = {n: block_of.get(n, BLOCK_TOKENS) for n in names}
    cache_file = cache_dir / "static.json"
    cache: dict[str, Any] = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    pool = ProcessPoolExecutor(max_workers=args.jobs)
    searches: dict[tuple[str, str], Future[Any]] = {}
    for n in names:
        for r in routers:
            if _key(traces[n], r, blocks[n]) not in cache:
                searches[(n, r)] = pool.submit(workload_static, n, str(traces[n]), r, 95.0, blocks[n])
    runs: dict[RunKey, list[Future[dict[str, Any]]]] = {}

    def submit(n: str, r: str, start: str, st: float, initial: tuple[int, int]) -> None:
        times = args.repeat if r == "kv" else 1
        runs[(n, r, start, st)] = [
            pool.submit(workload_row, n, str(traces[n]), r, st, initial, mapping, blocks[n])
            for _ in range(times)
        ]

    fleets: dict[tuple[str, str], Any] = {}
    try:
        # Runs from 1+1 need no static fleet: they start at once; the others as each search ends.
        for n in names:
            for r in routers:
                submit(n, r, "1+1", 0.0, (1, 1))
        for n in names:
            for r in routers:
                key = _key(traces[n], r, blocks[n])
                if key not in cache:
                    t0 = time.perf_counter()
                    _remember(cache, cache_file, key, searches[(n, r)].result())
                    print(
                        f"  [{n} {r}: static search done, {time.perf_counter() - t0:.0f} s waited]",
                        file=sys.stderr,
                    )
                fleets[(n, r)] = cache[key]
                if cache[key] is None:
                    continue
                need = (int(cache[key][0][0]), int(cache[key][0][1]))
                for st in startups:
                    submit(n, r, "need", st, need)
        results = _print(names, routers, startups, fleets, runs)
        if 0.0 in startups:
            results += _equal_goodput(names, routers, traces, blocks, runs, cache, cache_file, pool)
    finally:
        pool.shutdown(cancel_futures=True)
    print(f"\n{time.perf_counter() - t_start:.0f} s for the table, {args.jobs} jobs")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


RunKey = tuple[str, str, str, float]  # (workload, router, "need" or "1+1", cold start in seconds)


def median_run(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run printed for a row: the median by GPU-hours (the lower middle of an even count)."""
    return sorted(summaries, key=lambda s: float(s["gpu_hours"]))[(len(summaries) - 1) // 2]


def spread_line(summaries: list[dict[str, Any]], verdicts: list[Verdict], static_gpu_h: float | None) -> str:
    """The spread of a row's repeated runs: goodput, GPU-hours ratio, changes of direction, targets met."""

    def span(values: list[float], fmt: str) -> str:
        lo, hi = min(values), max(values)
        return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"

    good = span([float(s["goodput_pct"]) for s in summaries], ".1f")
    gpu = [float(s["gpu_hours"]) for s in summaries]
    cost = f"{span([g / static_gpu_h for g in gpu], '.2f')}x" if static_gpu_h else f"{span(gpu, '.3f')} GPU-h"
    flips = ",".join(span([v.flips_per_30_min[p] for v in verdicts], ".1f") for p in ("prefill", "decode"))
    met = sum(v.met for v in verdicts)
    return (
        f"{'':<{NAME_WIDTH[0]}} {len(summaries)} runs: goodput {good}%, {cost}, changes of direction per "
        f"30 min {flips}, targets met in {met} of {len(summaries)}"
    )


def _replayable(file: str, name: str, opts: TraceOptions, cache_dir: Path) -> tuple[Path, int]:
    """``--trace FILE`` as a Mooncake trace (``trace_files.prepare_trace``: a CSV converted with the prefix
    sharing modelled as the Azure workloads are, a window cut, sped up; written under ``cache_dir`` when
    anything changed) and its prompt tokens per hash id. Prints what was read."""
    cut = "" if opts.window is None else f"-{opts.window.start_s:g}-{opts.window.length_s}"
    out = cache_dir / f"{name}-{opts.seed}-{opts.share:g}{cut}.jsonl"

    def progress(rows: int) -> None:
        print(f"--trace {file}: {rows:,} rows read", file=sys.stderr)

    prepared = prepare_trace(file, out, opts, progress)
    print(f"--trace {prepared.note}", file=sys.stderr)
    return prepared.path, prepared.block_size


def _remember(cache: dict[str, Any], cache_file: Path, key: str, found: Any) -> None:
    """Store one static search's answer ((P, D), summary) or None, and write the cache file at once."""
    cache[key] = None if found is None else [list(found[0]), found[1]]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(cache, indent=1))


def _equal_goodput(
    names: list[str],
    routers: list[str],
    traces: dict[str, Path],
    blocks: dict[str, int],
    runs: dict[RunKey, list[Future[dict[str, Any]]]],
    cache: dict[str, Any],
    cache_file: Path,
    pool: ProcessPoolExecutor,
) -> list[dict[str, Any]]:
    """The second table: each 0 s run from the need against the cheapest static fleet reaching the
    planner's own goodput (rounded down to 0.1 point), not 95%: a hindsight fleet's cost at equal goodput."""
    wanted: dict[tuple[str, str], tuple[dict[str, Any], float, str]] = {}
    searches: dict[tuple[str, str], Future[Any]] = {}
    for n in names:
        for r in routers:
            if (n, r, "need", 0.0) not in runs:
                continue
            s = median_run([f.result() for f in runs[(n, r, "need", 0.0)]])
            target = int(float(s["goodput_pct"]) * 10) / 10
            key = f"{_key(traces[n], r, blocks[n])}@{target:g}"
            wanted[(n, r)] = (s, target, key)
            if key not in cache:
                searches[(n, r)] = pool.submit(workload_static, n, str(traces[n]), r, target, blocks[n])
    print("\nAt equal goodput (0 s, from the need): the cheapest static fleet reaching the run's goodput")
    cols = ("workload", "router", "planner", "GPU-h", "static", "goodput", "GPU-h", "x")
    print("{:<{w}} {:<11} {:>8} {:>7}  {:>7} {:>8} {:>7} {:>5}".format(*cols, w=NAME_WIDTH[0]))
    out: list[dict[str, Any]] = []
    for (n, r), (s, target, key) in wanted.items():
        if key not in cache:
            _remember(cache, cache_file, key, searches[(n, r)].result())
        head = f"{n:<{NAME_WIDTH[0]}} {r:<11} {s['goodput_pct']:>7.1f}% {s['gpu_hours']:>7.3f}  "
        if cache[key] is None:
            print(head + f"no static fleet up to 128+128 reaches {target:g}%", flush=True)
            continue
        (p, d), st = cache[key]
        ratio = float(s["gpu_hours"]) / float(st["gpu_hours"])
        print(
            head + f"{f'{p}+{d}':>7} {st['goodput_pct']:>7.1f}% {st['gpu_hours']:>7.3f} {ratio:>5.2f}",
            flush=True,
        )
        out.append({"scenario": n, "router": r, "policy": f"static {p}+{d} at {target:g}%", **st})
    return out


def _print(
    names: list[str],
    routers: list[str],
    startups: list[float],
    fleets: dict[tuple[str, str], Any],
    runs: dict[RunKey, list[Future[dict[str, Any]]]],
) -> list[dict[str, Any]]:
    print(header())
    print(
        f"{'':<{NAME_WIDTH[0]}} {'':<11} {'':<6} {'':>5}  {'':>8} {'':>7} {'':>7} {'':>13} {'':>8} {'':>6}  "
        "targets met"
    )
    results: list[dict[str, Any]] = []
    for n in names:
        for r in routers:
            found = fleets[(n, r)]
            static_gpu_h = None
            if found is None:
                print(f"{n:<{NAME_WIDTH[0]}} {r:<11} no static fleet up to 128+128 reaches 95%")
            else:
                (p, d), s = found
                static_gpu_h = float(s["gpu_hours"])
                print(row(n, r, f"{p}+{d}", "-", s, static_gpu_h), flush=True)
                results.append({"scenario": n, "router": r, "policy": f"static {p}+{d}", **s})
            keys = [("need", st) for st in startups] + [("1+1", 0.0)]
            for start, st in keys:
                if (n, r, start, st) not in runs:
                    continue
                summaries = [f.result() for f in runs[(n, r, start, st)]]
                label = "need" if start == "need" else "1+1"
                print(row(n, r, label, f"{st:g}", median_run(summaries), static_gpu_h), flush=True)
                verdicts = [judge(s, st, start == "1+1", static_gpu_h) for s in summaries]
                for i, (s, v) in enumerate(zip(summaries, verdicts, strict=True)):
                    one = {**s, "from": start, "targets_met": v.met, "gpu_hours_ratio": v.gpu_hours_ratio}
                    results.append(one if len(summaries) == 1 else {**one, "repeat": i})
                if len(summaries) > 1:
                    print(spread_line(summaries, verdicts, static_gpu_h), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
