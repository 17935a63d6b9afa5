"""The one-command disaggregated demo: ``python launch/demo.py [flags]`` (``make demo``).

Builds the tiny model, starts nats-server, Dynamo's frontend, one prefill and one decode vLLM worker
(NIXL KV transfer on CPU) and the planner with its ``local`` connector (one warm decode standby); drives a
warm-up / decode-heavy burst / idle load through the OpenAI API with a live view; writes an HTML report and
a four-line verdict into ``runs/<timestamp>/`` (``--compare``: the same load with the planner off first);
stops every process it started, whichever way it ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from dynamo.common.cli_setup import add_version_flag, setup_logging

from .runner import DemoRun, make_config, nixl_available

# launch/demo_lib/cli.py -> the repository root (runs/ goes there).
REPO = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/demo.py", description=__doc__.split("\n")[0])
    add_version_flag(p, "launch/demo.py")
    p.add_argument(
        "--duration",
        type=float,
        default=240.0,
        help="seconds of load: 10%% (at most 20 s) warm-up, 50%% decode-heavy burst, the rest idle "
        "(default 240; minimum 30)",
    )
    p.add_argument(
        "--intensity",
        type=float,
        default=1.0,
        help="burst load multiplier: concurrent streams = round(16 x intensity) (default 1.0)",
    )
    p.add_argument(
        "--agg",
        action="store_true",
        help="aggregated variant: one engine does prefill and decode; the planner scales it alone",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="after the report, leave the stack up for exploring until Ctrl-C",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="folder for logs, recordings and the report (default runs/<UTC timestamp>/)",
    )
    p.add_argument("--namespace", default="demo", help="Dynamo namespace of the stack (default demo)")
    p.add_argument("--decode-max", type=int, default=2, help="planner's decode pool maximum (default 2)")
    p.add_argument("--prefill-max", type=int, default=2, help="planner's prefill pool maximum (default 2)")
    p.add_argument(
        "--planner-interval", type=float, default=3.0, help="seconds between planner decisions (default 3)"
    )
    p.add_argument(
        "--scale-down-window",
        type=float,
        default=15.0,
        help="the planner's scale-down stabilization and demand window: a pool shrinks to the highest "
        "need of the last S seconds, and one idle for S seconds needs none (default 15)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=420.0,
        help="seconds to wait for the workers to become ready (default 420)",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=150.0,
        help="after the load, seconds to wait for both pools to return to their minimum (default 150)",
    )
    p.add_argument(
        "--run-id",
        default=None,
        help="marker put into every started process's environment as DEMO_RUN_ID, so tests and scripts "
        "can find them (default: random)",
    )
    p.add_argument(
        "--decode-standby",
        type=int,
        default=1,
        help="warm decode standbys the planner keeps (loaded, not registered; a scale-up promotes one in "
        "well under a second); 0 = start every added replica from scratch (default 1)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="first run the same load with the planner off (into RUN/planner-off/), then the demo; the "
        "verdict and the report show both",
    )
    p.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="full-screen live view (default: on when stdout is a terminal, else one status line every 10 s)",
    )
    return p


def quiet_http_clients() -> None:
    """The load's HTTP client logs every request at INFO (hundreds per run), which drowns the progress
    view."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    quiet_http_clients()
    run_dir = args.run_dir or REPO / "runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    agg = args.agg
    if not agg and not nixl_available(sys.executable):
        agg = True
        notes.append(
            "the 'nixl' package does not import here, so real prefill/decode disaggregation cannot run: "
            "falling back to the AGGREGATED variant (one engine per replica)."
        )
    if args.decode_standby < 0:
        print("launch/demo.py: error: --decode-standby must be >= 0", file=sys.stderr)
        return 2
    run_id = args.run_id or uuid.uuid4().hex[:12]
    baseline = None
    if args.compare:
        off = make_run(args, run_dir / "planner-off", agg, notes, run_id, planner=False)
        rc = off.run()
        if rc != 0:
            return rc
        baseline = json.loads((off.cfg.run_dir / "verdict.json").read_text())
    return make_run(args, run_dir, agg, notes, run_id, baseline=baseline).run()


def make_run(
    args: argparse.Namespace,
    run_dir: Path,
    agg: bool,
    notes: list[str],
    run_id: str,
    *,
    planner: bool = True,
    baseline: dict[str, object] | None = None,
) -> DemoRun:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = make_config(
        run_dir,
        planner=planner,
        decode_standby=args.decode_standby,
        namespace=args.namespace,
        agg=agg,
        duration_s=args.duration,
        intensity=args.intensity,
        decode_max=args.decode_max,
        prefill_max=args.prefill_max,
        planner_interval_s=args.planner_interval,
        scale_down_window_s=args.scale_down_window,
        extra_env={
            k: v for k, v in os.environ.items() if k.startswith(("UCX_", "VLLM_CPU_", "OMP_", "DYN_VLLM_"))
        },
    )
    return DemoRun(
        cfg,
        run_id=run_id,
        live=args.live,
        startup_timeout_s=args.startup_timeout,
        settle_timeout_s=args.settle_timeout,
        keep_running=args.keep_running and planner,
        notes=notes,
        baseline=baseline,
    )
