"""Upstream Dynamo 1.6.1's own planner (load-based scaling) on Dynamo's fleet simulator.

Runs only with the isolated interpreter that ``make upstream-planner-env`` builds::

    .cache/upstream-planner/venv/bin/python benchmarks/upstream_planner/run.py \\
        --trace FILE --prefill-engine-args JSON --decode-engine-args JSON \\
        [--startup-time S] [--sla-ttft-ms MS] [--sla-itl-ms MS] [--initial P,D] \\
        [--planner-config JSON] [--json] [--quiet]

The replay goes through upstream's own entry point, ``dynamo.replay.run_trace_replay(...,
planner_config=...)``, read from the unpacked ``ai-dynamo==1.6.1`` wheel under .cache (nothing of
upstream's is copied into this repository). ``aisimulate`` / ``aisimulate_core`` are import-only
stand-ins (see standins/): load-based scaling does not use them.

With ``--json`` the last stdout line is one JSON object (see ``result_record``). Bad input exits 2
with one line on stderr; progress and upstream's warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

PLANNER = "upstream-1.6.1"
POOLS = ("prefill", "decode")

# The disaggregated load-based configuration (docs: /work/shared/notes/planner-simulation.md).
BASE_PLANNER_CONFIG: dict[str, Any] = {
    "mode": "disagg",
    "backend": "mocker",
    "environment": "virtual",
    "optimization_target": "throughput",
    "enable_load_scaling": True,
    "enable_throughput_scaling": False,
    "load_adjustment_interval_seconds": 5,
    "min_endpoint": 1,
    "max_gpu_budget": 16,
    "prefill_engine_num_gpu": 1,
    "decode_engine_num_gpu": 1,
}


def _our_inputs() -> Any:
    """Our ``dynamo.planner.sim.inputs`` by file path: in this venv ``dynamo.planner`` is upstream's.

    It needs only the standard library (and the runtime's mocker config check, the same 1.6.1 here),
    so both planners read the same traces, engine args and fleet sizes with the same checks.
    """
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "components/src/dynamo/planner/sim/inputs.py"
    spec = importlib.util.spec_from_file_location("dynamo_fpm_sim_inputs", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_inputs = _our_inputs()
InputError = _inputs.SimInputError


# --------------------------------------------------------------------------- input


def planner_config(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The base config with ``--planner-config`` merged on top (nested objects merged key by key)."""

    def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for k, v in top.items():
            out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
        return out

    cfg = merge(BASE_PLANNER_CONFIG, overrides)
    from dynamo.planner.config.planner_config import PlannerConfig

    try:
        PlannerConfig.from_config_arg(json.dumps(cfg))
    except Exception as exc:  # pydantic's ValidationError and upstream's own ValueErrors
        lines = [
            ln.strip()
            for ln in str(exc).splitlines()
            if ln.strip() and not ln.strip().startswith("For further")
        ]
        raise InputError(f"planner-config: {'; '.join(lines[:3]) or type(exc).__name__}") from None
    return cfg


def check_upstream_import() -> None:
    """Refuse to run unless ``dynamo.planner`` is upstream's (the unpacked wheel), not this repo's."""
    try:
        import dynamo.planner
        import dynamo.replay
    except ImportError as exc:
        raise SystemExit(
            f"run.py: upstream Dynamo is not importable ({exc}); run `make upstream-planner-env` and use "
            ".cache/upstream-planner/venv/bin/python"
        ) from None
    for mod in (dynamo.planner, dynamo.replay):
        where = Path(str(mod.__file__)).resolve().parents[2]
        if not (where / "ai_dynamo-1.6.1.dist-info").is_dir():
            raise SystemExit(
                f"run.py: {mod.__name__} comes from {where}, not the unpacked ai-dynamo 1.6.1 wheel; "
                "use .cache/upstream-planner/venv/bin/python without PYTHONPATH"
            )


# --------------------------------------------------------------------------- result


def scaling_counts(events: Iterable[Any], initial: tuple[int, int]) -> tuple[dict[str, int], int]:
    """Target changes per pool, and direction reversals of consecutive changes (summed over pools)."""
    target = dict(zip(POOLS, initial, strict=True))
    actions = dict.fromkeys(POOLS, 0)
    last_dir: dict[str, int] = {}
    flips = 0
    for ev in sorted(events, key=lambda e: float(_field(e, "at_s"))):
        pool = str(_field(ev, "component"))
        if pool not in target:
            continue
        to = int(_field(ev, "to_count"))
        if to == target[pool]:
            continue
        direction = 1 if to > target[pool] else -1
        actions[pool] += 1
        if pool in last_dir and last_dir[pool] != direction:
            flips += 1
        last_dir[pool] = direction
        target[pool] = to
    return actions, flips


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def planner_ops(lifecycle_operations: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Planner-caused lifecycle operations per pool (a cross-check of the target changes)."""
    out = dict.fromkeys(POOLS, 0)
    for op in lifecycle_operations:
        if op.get("cause") == "planner_scale" and op.get("pool") in out:
            out[str(op["pool"])] += 1
    return out


def result_record(report: Any, initial: tuple[int, int], wall_s: float) -> dict[str, Any]:
    s = report.summary
    requests = int(s["num_requests"])
    # The simulator reports goodput only when an SLA bound was given; null otherwise (not 0).
    good_raw = s.get("goodput_completed_requests")
    good = None if good_raw is None else int(good_raw)
    events = report.planner.scaling_events if report.planner is not None else []
    actions, flips = scaling_counts(events, initial)

    def num(key: str) -> float | None:
        v = s.get(key)
        return None if v is None else float(v)

    return {
        "planner": PLANNER,
        "requests": requests,
        "completed_requests": int(s["completed_requests"]),
        "goodput_requests": good,
        "goodput_pct": None if good is None else (round(100.0 * good / requests, 2) if requests else 0.0),
        "gpu_hours": float(s["gpu_hours"]),
        "p90_ttft_ms": num("p90_ttft_ms"),
        "p90_itl_ms": num("p90_itl_ms"),
        "scaling_actions": sum(actions.values()),
        "direction_flips": flips,
        "actions": actions,
        "wall_s": round(wall_s, 2),
    }


def render(rec: Mapping[str, Any], extra: Mapping[str, Any]) -> str:
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    return "\n".join(
        [
            f"upstream Dynamo 1.6.1 planner (load-based; aisimulate stand-ins, unused), "
            f"simulated {extra['duration_s']:.0f} s from {extra['initial'][0]}+{extra['initial'][1]}, "
            f"startup {extra['startup_s']}",
            f"  requests {rec['requests']}, completed {rec['completed_requests']}, "
            + (
                "no SLA bound given (no goodput)"
                if rec["goodput_requests"] is None
                else f"within SLA {rec['goodput_requests']} ({rec['goodput_pct']:.1f}%; "
                f"TTFT <= {extra['sla_ttft_ms']}, ITL <= {extra['sla_itl_ms']})"
            ),
            f"  GPU-hours {rec['gpu_hours']:.3f}; p90 TTFT {ms(rec['p90_ttft_ms'])}, p90 ITL "
            f"{ms(rec['p90_itl_ms'])}",
            f"  scaling actions {rec['scaling_actions']} (prefill {rec['actions']['prefill']}, decode "
            f"{rec['actions']['decode']}), direction flips {rec['direction_flips']}; "
            f"lifecycle planner ops {extra['planner_ops']}",
            f"  wall {rec['wall_s']:.1f} s",
        ]
    )


def _startup_text(prefill_s: Any, decode_s: Any) -> str:
    def one(v: Any) -> str:
        return "none (mocker default)" if v is None else f"{float(v):g} s"

    return one(prefill_s) if prefill_s == decode_s else f"prefill {one(prefill_s)} / decode {one(decode_s)}"


# --------------------------------------------------------------------------- progress


class Progress:
    """Progress lines on stderr while the replay runs: simulated time, from the planner's ticks."""

    def __init__(self, horizon_s: float, enabled: bool, every_s: float = 10.0) -> None:
        self.horizon_s = horizon_s
        self.enabled = enabled
        self.every_s = every_s
        self.sim_s = 0.0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, msg: str) -> None:
        if self.enabled:
            print(f"[upstream-planner {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def hook(self) -> Callable[[], None]:
        """Wrap the adapter's on_tick to note simulated time; returns the undo."""
        from dynamo.planner.offline.replay_adapter import ReplayPlannerAdapter

        original = ReplayPlannerAdapter.on_tick
        progress = self

        def on_tick(self: Any, result: dict[str, Any]) -> dict[str, Any]:
            progress.sim_s = float(result.get("now_ms", 0.0)) / 1000.0
            return original(self, result)

        # Upstream's adapter has no hook for its ticks: its method is replaced for the run, then put back.
        ReplayPlannerAdapter.on_tick = on_tick  # type: ignore[method-assign]

        def undo() -> None:
            ReplayPlannerAdapter.on_tick = original  # type: ignore[method-assign]  # put back (see above)

        return undo

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.say(f"simulated {self.sim_s:.0f} s of ~{self.horizon_s:.0f} s of traffic")


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        print(f"run.py: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="run.py",
        description="Upstream Dynamo 1.6.1's load-based planner on Dynamo's fleet simulator (mocker, virtual "
        "clock).",
    )
    ap.add_argument(
        "--trace",
        action="append",
        required=True,
        metavar="FILE",
        help="Mooncake JSON-lines trace (repeatable: replayed together)",
    )
    ap.add_argument(
        "--prefill-engine-args",
        required=True,
        metavar="JSON",
        help="mocker config of a prefill engine (inline JSON or a file)",
    )
    ap.add_argument(
        "--decode-engine-args",
        required=True,
        metavar="JSON",
        help="mocker config of a decode engine (inline JSON or a file)",
    )
    ap.add_argument(
        "--startup-time",
        type=float,
        metavar="S",
        help="seconds a new worker takes to serve (overrides startup_time of both)",
    )
    ap.add_argument("--sla-ttft-ms", type=float, metavar="MS", help="TTFT bound for goodput")
    ap.add_argument("--sla-itl-ms", type=float, metavar="MS", help="ITL bound for goodput")
    ap.add_argument("--initial", default="1,1", metavar="P,D", help="the fleet at the start (default: 1,1)")
    ap.add_argument(
        "--planner-config",
        metavar="JSON",
        help="merged on top of the disagg load-based config (inline JSON or a file)",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        dest="json_stdout",
        help="the result as one JSON object, the last stdout line",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("DYN_LOG", "warn")  # upstream logs every tick at INFO; read when dynamo loads
    try:
        check_upstream_import()
        for what, v in (("sla-ttft-ms", args.sla_ttft_ms), ("sla-itl-ms", args.sla_itl_ms)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise InputError(f"{what}: must be > 0, got {v:g}")
        if args.startup_time is not None and not (
            math.isfinite(args.startup_time) and args.startup_time >= 0
        ):
            raise InputError(f"startup-time: must be >= 0, got {args.startup_time:g}")
        horizon_s = max(_inputs.check_trace(t) for t in args.trace)
        prefill = _inputs.engine_args(
            _inputs.parse_json_arg(args.prefill_engine_args, "prefill-engine-args"),
            "prefill",
            args.startup_time,
        )
        decode = _inputs.engine_args(
            _inputs.parse_json_arg(args.decode_engine_args, "decode-engine-args"), "decode", args.startup_time
        )
        initial = _inputs.parse_fleet(args.initial, "initial")
        overrides = (
            _inputs.parse_json_arg(args.planner_config, "planner-config") if args.planner_config else {}
        )
        cfg = planner_config(overrides)
    except InputError as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="upstream-planner-"))
    keep_reports = "report_output_dir" in overrides
    if not keep_reports:
        cfg["report_output_dir"] = str(work / "reports")  # upstream writes an HTML report; not kept
    try:
        if len(args.trace) == 1:
            trace_file = str(Path(args.trace[0]).resolve())
        else:
            trace_file = str(_inputs.merge_traces(list(args.trace), work / "merged.jsonl"))
        from dynamo.replay import run_trace_replay

        progress = Progress(horizon_s, enabled=not args.quiet)
        progress.say(f"replaying ~{horizon_s:.0f} s of traffic with upstream's planner")
        undo = progress.hook()
        t0 = time.monotonic()
        try:
            with progress:
                report = run_trace_replay(
                    [trace_file],
                    prefill_engine_args=prefill,
                    decode_engine_args=decode,
                    num_prefill_workers=initial[0],
                    num_decode_workers=initial[1],
                    sla_ttft_ms=args.sla_ttft_ms,
                    sla_itl_ms=args.sla_itl_ms,
                    planner_config=cfg,
                    trace_format="mooncake",
                )
        finally:
            undo()
        wall_s = time.monotonic() - t0
        progress.say(f"done in {wall_s:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rec = result_record(report, initial, wall_s)
    if args.json_stdout:
        print(json.dumps(rec), flush=True)
    else:
        extra = {
            "duration_s": float(report.summary.get("duration_ms") or 0.0) / 1000.0,
            "initial": initial,
            "startup_s": _startup_text(prefill.get("startup_time"), decode.get("startup_time")),
            "sla_ttft_ms": "-" if args.sla_ttft_ms is None else f"{args.sla_ttft_ms:g} ms",
            "sla_itl_ms": "-" if args.sla_itl_ms is None else f"{args.sla_itl_ms:g} ms",
            "planner_ops": planner_ops(report.planner.lifecycle_operations if report.planner else []),
        }
        print(render(rec, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
