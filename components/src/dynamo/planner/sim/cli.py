"""``python -m dynamo.planner simulate``: the planner on Dynamo's fleet simulator.

See docs/planner-evaluation.md."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TextIO

from ..config import ConfigError, PlannerConfig
from .connector import POOLS
from .harness import ROUTERS, SimSpec, simulate
from .inputs import SimInputError, check_trace, engine_args, parse_fleet, parse_json_arg, prompts_over
from .prefixes import BLOCK_TOKENS, DEFAULT_SHARE
from .scenarios import SCENARIOS, write_trace
from .trace_files import Prepared, TraceOptions, prepare_trace
from .trace_rows import parse_window
from .workloads import LONG_CONTEXT, SLA_ITL_MS, SLA_TTFT_MS, WORKLOADS, write_workload

# ``--engines``: each pool's mocker config before ``--{pool}-engine-args`` (``{}``: the mocker's defaults
# as ``inputs.engine_args`` completes them).
ENGINE_PAIRS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {"prefill": {}, "decode": {}},
    "long-context": LONG_CONTEXT,
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser(
        "simulate", help="run the planner (or a static fleet) on Dynamo's fleet simulator"
    )
    source = sp.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace",
        action="append",
        metavar="FILE",
        help="a trace (repeatable): Mooncake JSON lines, or a CSV in Azure's format "
        "(TIMESTAMP,ContextTokens,GeneratedTokens) or BurstGPT's (Timestamp,Request tokens,Response tokens,"
        "...) replayed with modelled prefix sharing (--prefix-share, --seed)",
    )
    source.add_argument(
        "--scenario",
        metavar="NAME",
        help="a named scenario instead of a trace, run as the benchmarks run it (SLA TTFT 2 s / ITL 50 ms, "
        "max_replicas 64 per pool and its starting fleet unless given): the suite's (default engines) or a "
        "workload's (azure-conv-x2, gen-bursty, ...: long-context engines); docs/planner-evaluation.md "
        "lists them",
    )
    sp.add_argument(
        "--seed",
        type=int,
        default=0,
        help="--scenario: the trace's seed; a CSV --trace: the prefix sharing's (default: 0)",
    )
    sp.add_argument(
        "--prefix-share",
        type=float,
        metavar="F",
        help=f"--scenario, a workload, or a CSV --trace: the share of requests continuing an "
        f"earlier one (default: {DEFAULT_SHARE:g})",
    )
    sp.add_argument(
        "--trace-block-size",
        type=int,
        metavar="N",
        help=f"--trace (Mooncake): prompt tokens each hash id stands for (default: read from the trace, "
        f"the size every request's ids agree with, else {BLOCK_TOKENS}; Mooncake's published traces hash "
        f"512-token blocks, the traces this package writes 64)",
    )
    sp.add_argument(
        "--trace-window",
        metavar="START:LENGTH",
        help="--trace: replay only this part, in the trace's own time from its first request (2h:1h is the "
        "third hour; units s, m, h, d; START: to the end; LENGTH alone from the start)",
    )
    sp.add_argument(
        "--trace-speedup",
        type=float,
        metavar="F",
        help="--trace: replay the requests F times faster (2: the same requests in half the time, as the "
        "azure-*-x2 workloads are made) (default: 1)",
    )
    sp.add_argument(
        "--router",
        choices=list(ROUTERS),
        default="round-robin",
        help="how the simulated frontend routes requests: round-robin, or kv (Dynamo's KV-aware router, "
        "which sends a request to the engine holding most of its prefix) (default: round-robin)",
    )
    sp.add_argument("--config", help="planner config, as `run --config` takes it (file or inline JSON/YAML)")
    sp.add_argument(
        "--interval", type=float, dest="interval_s", help="seconds between decisions (default: 5)"
    )
    sp.add_argument("--target", choices=["throughput", "latency", "load", "sla"], help="scaling target")
    sp.add_argument("--gpu-budget", type=int, help="GPUs for both pools together (default: none)")
    sp.add_argument(
        "--engines",
        choices=list(ENGINE_PAIRS),
        help="the engine pair: default (the suite's: 8192 blocks of 64 tokens, 64 sequences, 16k context "
        "each) or long-context (the workloads': prefill 8192 and decode 4096 blocks, 64 sequences, 256k "
        "context; what bench_planner_traffic.py --trace judges a trace on) (default: a workload's "
        "long-context, else default)",
    )
    for pool in ("prefill", "decode"):
        sp.add_argument(
            f"--{pool}-engine-args",
            metavar="JSON",
            help=f"mocker config of a {pool} engine, inline JSON or a file (replaces --engines' for it)",
        )
    sp.add_argument(
        "--startup-time", type=float, metavar="S", help="seconds a new worker takes to serve (default: 60)"
    )
    sp.add_argument(
        "--sla-ttft-ms",
        type=float,
        metavar="MS",
        help="TTFT bound (default: the config's sla.ttft_ms; --scenario: 2000)",
    )
    sp.add_argument(
        "--sla-itl-ms",
        type=float,
        metavar="MS",
        help="ITL bound (default: the config's sla.itl_ms; --scenario: 50)",
    )
    sp.add_argument(
        "--static", metavar="P,D", help="a fixed fleet of P prefill and D decode workers, no planner"
    )
    sp.add_argument(
        "--initial",
        metavar="P,D",
        help="planner runs: the fleet at the start (default: the pools' minimums, >= 1)",
    )
    sp.add_argument(
        "--json",
        action="store_true",
        dest="json_stdout",
        help="the summary as one JSON object, the last line",
    )
    sp.add_argument(
        "--report", metavar="DIR", help="write report.html, summary.json, timeline.json, decisions.jsonl"
    )
    sp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return sp


def build_spec(args: argparse.Namespace, cfg: PlannerConfig) -> SimSpec:
    block = BLOCK_TOKENS if args.trace_block_size is None else args.trace_block_size
    durations = [check_trace(t, block) for t in args.trace]
    workload = WORKLOADS.get(args.scenario or "")
    defaults = ENGINE_PAIRS[args.engines or ("long-context" if workload else "default")]
    prefill = engine_args(
        parse_json_arg(args.prefill_engine_args, "prefill-engine-args") or defaults["prefill"],
        "prefill",
        args.startup_time,
    )
    decode = engine_args(
        parse_json_arg(args.decode_engine_args, "decode-engine-args") or defaults["decode"],
        "decode",
        args.startup_time,
    )
    for what, v in (
        ("sla-ttft-ms", args.sla_ttft_ms),
        ("sla-itl-ms", args.sla_itl_ms),
        ("startup-time", args.startup_time),
    ):
        if v is not None and (v < 0 or (v == 0 and what != "startup-time")):
            raise SimInputError(f"{what}: must be {'>= 0' if what == 'startup-time' else '> 0'}, got {v:g}")
    static = parse_fleet(args.static, "static") if args.static else None
    # A named scenario is judged as the benchmarks judge it (the suite and the workloads share the SLA).
    sla_ttft, sla_itl = (SLA_TTFT_MS, SLA_ITL_MS) if args.scenario else (cfg.sla.ttft_ms, cfg.sla.itl_ms)
    if args.initial:
        initial = parse_fleet(args.initial, "initial")
    elif workload:
        initial = workload.initial
    elif args.scenario:
        initial = SCENARIOS[args.scenario].initial
    else:
        initial = (max(cfg.prefill.min_replicas, 1), max(cfg.decode.min_replicas, 1))
    return SimSpec(
        traces=tuple(args.trace),
        prefill_engine_args=prefill,
        decode_engine_args=decode,
        sla_ttft_ms=args.sla_ttft_ms if args.sla_ttft_ms is not None else sla_ttft,
        sla_itl_ms=args.sla_itl_ms if args.sla_itl_ms is not None else sla_itl,
        initial=initial,
        static=static,
        trace_duration_s=max(durations),
        router=args.router,
        trace_block_size=block,
    )


def scenario_trace(args: argparse.Namespace, folder: str) -> str:
    """``--scenario``'s trace written under ``folder``; SimInputError for an unknown name or a bad share."""
    name = args.scenario
    path = f"{folder}/{name}-{args.seed}.jsonl"
    if name in WORKLOADS:
        share = DEFAULT_SHARE if args.prefix_share is None else args.prefix_share
        if not 0 <= share <= 1:
            raise SimInputError(f"prefix-share: must be within [0, 1], got {share:g}")
        return str(write_workload(name, path, args.seed, share))
    if name in SCENARIOS:
        if args.prefix_share is not None:
            raise SimInputError(f"prefix-share: applies to the workloads, not the suite's {name!r}")
        return str(write_trace(name, path, args.seed))
    known = ", ".join([*SCENARIOS, *WORKLOADS])
    raise SimInputError(f"scenario: unknown {name!r}; known: {known}")


def replayable_traces(args: argparse.Namespace, folder: str, quiet: bool = False) -> list[Prepared]:
    """``--trace`` files as Mooncake traces (``trace_files.prepare_trace``: CSVs converted under ``folder``
    with the prefix sharing modelled, a window cut, a speed-up applied), all at one block size;
    ``--prefix-share`` refused when no file is a CSV (a Mooncake trace has its hash ids)."""
    window = parse_window(args.trace_window) if args.trace_window is not None else None
    share = DEFAULT_SHARE if args.prefix_share is None else args.prefix_share
    speedup = 1.0 if args.trace_speedup is None else args.trace_speedup
    opts = TraceOptions(window, speedup, share, args.seed, args.trace_block_size)

    def progress(rows: int) -> None:
        if not quiet:
            print(f"simulate: {rows:,} rows read", file=sys.stderr)

    prepared = [
        prepare_trace(path, f"{folder}/trace-{i}.jsonl", opts, progress) for i, path in enumerate(args.trace)
    ]
    if args.prefix_share is not None and all(p.kind == "Mooncake" for p in prepared):
        raise SimInputError(
            "prefix-share: applies to --scenario and CSV traces (Azure, BurstGPT); a Mooncake trace carries "
            "its own hash_ids"
        )
    blocks = sorted({p.block_size for p in prepared})
    if len(blocks) > 1:
        raise SimInputError(
            f"trace-block-size: the traces hash blocks of different sizes ({', '.join(map(str, blocks))} "
            "tokens); replay them one at a time"
        )
    return prepared


def admitted_tokens(prefill_engine_args: Mapping[str, Any], decode_engine_args: Mapping[str, Any]) -> int:
    """The longest prompt both engines of a pair admit: the shorter context, or KV, of the two (normalized
    configs, ``inputs.engine_args``)."""
    return min(
        min(int(e["max_model_len"]), int(e["num_gpu_blocks"]) * int(e["block_size"]))
        for e in (prefill_engine_args["engine"], decode_engine_args["engine"])
    )


def admission_warning(spec: SimSpec) -> str | None:
    """A line when some prompts are longer than an engine admits: the simulator rejects them, and they count
    against goodput (the suite's default engines hold 16k tokens; the workloads' 256k)."""
    limit = admitted_tokens(spec.prefill_engine_args, spec.decode_engine_args)
    over, longest = 0, 0
    for trace in spec.traces:
        n, top = prompts_over(trace, limit)
        over, longest = over + n, max(longest, top)
    if not over:
        return None
    raise_it = "--prefill-engine-args and --decode-engine-args set max_model_len and num_gpu_blocks"
    pair = ENGINE_PAIRS["long-context"]
    most = admitted_tokens(*(engine_args(pair[pool], pool, None) for pool in ("prefill", "decode")))
    if limit < most:
        raise_it = f"--engines long-context admits {most}; {raise_it}"
    return (
        f"{over} requests have prompts longer than the engines admit ({limit} tokens; the longest "
        f"{longest}): the simulator rejects them and they count against goodput. {raise_it}"
    )


def render_table(s: dict[str, Any], cfg: PlannerConfig) -> str:
    who = f"static {s['static'][0]}+{s['static'][1]}" if s["static"] else f"planner (target {cfg.target})"

    def ms(key: str, digits: int) -> str:
        return "/".join(
            "-" if s[f"p{q}_{key}_ms"] is None else f"{s[f'p{q}_{key}_ms']:.{digits}f}" for q in (50, 90, 99)
        )

    rows = [
        f"simulated {s['duration_s']:.0f} s, {who}, {s['router']} router; startup {s['startup_time_s']:g} s, "
        f"SLA TTFT {s['sla_ttft_ms']:g} ms / ITL {s['sla_itl_ms']:g} ms",
        f"  requests            {s['requests']} ({s['completed_requests']} completed)",
        f"  SLA goodput         {s['goodput_pct']:.1f}% ({s['goodput_requests']} requests)",
        f"  GPU-hours           {s['gpu_hours']:.3f} (prefill {s['prefill_worker_seconds']:.0f} s, "
        f"decode {s['decode_worker_seconds']:.0f} s of workers)",
        f"  TTFT p50/p90/p99    {ms('ttft', 0)} ms",
        f"  ITL p50/p90/p99     {ms('itl', 1)} ms",
        f"  scaling actions     {s['scaling_actions']} (prefill {s['actions']['prefill']}, "
        f"decode {s['actions']['decode']}); direction flips {s['direction_flips']}",
        f"  peak replicas       prefill {s['peak_replicas']['prefill']}, "
        f"decode {s['peak_replicas']['decode']}",
        f"  wall time           planner {s['planner_wall_s']:.2f} s ({s['planner_ticks']} decisions), "
        f"simulator {s['simulator_wall_s']:.2f} s",
    ]
    if not s["static"]:
        timed = s["measured_startup_s"]
        each = ", ".join(f"{p} " + ("-" if timed[p] is None else f"{timed[p]:.0f} s") for p in POOLS)
        rows.insert(-1, f"  startup measured    {each} (until measured: {cfg.expected_startup_s:g} s)")
    return "\n".join(rows)


def run(args: argparse.Namespace, cfg: PlannerConfig, out: TextIO = sys.stdout) -> int:
    """Exit 0, or 2 with one line on stderr for bad input."""
    cfg = replace(cfg, json_stdout=False, tui=False, dry_run=False, use_model_cards=False)
    with tempfile.TemporaryDirectory(prefix="dynamo-simulate-") as folder:
        prepared: list[Prepared] = []
        try:
            if args.scenario:
                for flag in ("trace_block_size", "trace_window", "trace_speedup"):
                    if getattr(args, flag) is not None:
                        what = flag.replace("_", "-")
                        raise SimInputError(f"{what}: applies to --trace; a scenario's trace is written here")
                args = argparse.Namespace(**{**vars(args), "trace": [scenario_trace(args, folder)]})
            else:
                prepared = replayable_traces(args, folder, quiet=args.quiet)
                traces = [str(p.path) for p in prepared]
                block = prepared[0].block_size
                args = argparse.Namespace(**{**vars(args), "trace": traces, "trace_block_size": block})
            spec = build_spec(args, cfg)
        except (SimInputError, ConfigError) as exc:
            print(f"dynamo.planner simulate: error: {exc}", file=sys.stderr)
            return 2
        for p in prepared:  # what was read, once the run is sure to start
            if not args.quiet:
                print(f"simulate: {p.note}", file=sys.stderr)
        if (warning := admission_warning(spec)) is not None:
            print(f"dynamo.planner simulate: warning: {warning}", file=sys.stderr)
        return _run(args, cfg, spec, out)


def _run(args: argparse.Namespace, cfg: PlannerConfig, spec: SimSpec, out: TextIO) -> int:
    decisions = None
    if args.report:
        from pathlib import Path

        Path(args.report).mkdir(parents=True, exist_ok=True)
        decisions = str(Path(args.report) / "decisions.jsonl")
        Path(decisions).unlink(missing_ok=True)
    result = simulate(spec, cfg, decision_log=decisions, progress=not args.quiet)
    summary = result["summary"]
    if args.report:
        from .report import write_report

        html = write_report(result, args.report)
        summary = dict(summary, report=str(html))
        print(f"simulate: report {html}", file=sys.stderr)
    if args.json_stdout:
        out.write(json.dumps(summary, separators=(",", ":")) + "\n")
    else:
        out.write(render_table(summary, cfg) + "\n")
    return 0
