"""Benchmark: upstream Dynamo 1.6.1's own planner, live, scales the right pool from our workers' FPM records.

    .venv/bin/python benchmarks/bench_upstream_planner_live.py [--planes nats,zmq] [--shapes decode,prefill]
                                                               [--json] [--keep-logs]
    make bench-upstream-live [UPLIVE_ARGS="--planes zmq"]

Per event plane, real processes on free loopback ports: NATS (only for the ``nats`` plane), Dynamo's
frontend and our ``python -m dynamo.vllm`` as a disaggregated pair on the tiny model (prefill pool =
component ``prefill``, decode pool = ``backend``; file discovery). Then, per load shape, a fresh etcd (where
upstream's virtual connector keeps its decision) and upstream's planner ``python -m dynamo.planner`` from its
isolated venv (``benchmarks/upstream_planner/README.md``): ``environment: virtual``, ``mode: disagg``,
load-based scaling with ``optimization_target: load`` and the same two thresholds for every shape (a prefill
queue of one context; a decode KV utilization). Idle first (no decision may come), then the shape's load
through the frontend: ``decode`` (short prompts, long outputs: decode KV grows) must give "decode +1,
prefill unchanged", ``prefill`` (long prompts, two output tokens: prompts queue) "prefill +1, decode
unchanged". The decision is read where a deployment environment reads it (``VirtualConnectorClient``, in
``upstream_planner/live_observer.py``) and cross-checked in the planner's log. Nothing starts the extra
worker (a 2-core machine), so the first decision is the result: upstream's planner then holds, "scaling in
progress". Exit 0 when every trial passes, 1 otherwise, 2 when the isolated venv is missing.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dynamo.common.ports import free_port
from dynamo.common.process_group import kill_group
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.planner_support import EmbeddedEtcd
from dynamo_fpm_testing.worker_support import (
    ENGINE_FLAGS,
    Proc,
    base_env,
    http_json,
    kv_transfer_config_json,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    wait_until,
)

REPO = Path(__file__).resolve().parent.parent
UPSTREAM_PY = REPO / ".cache" / "upstream-planner" / "venv" / "bin" / "python"
OBSERVER = REPO / "benchmarks" / "upstream_planner" / "live_observer.py"
MODEL = "tiny"
BLOCK_SIZE = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--block-size") + 1])  # the workers' KV block
PLANES = ("nats", "zmq")
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "it", "was", "warm"]
# The load shapes and the pool each makes the right one to scale, under the same planner config. The wrong
# pool's threshold is out of reach by construction (`shape_bounds`): all of a shape's streams at once hold
# at most concurrency x (prompt + output) KV tokens on decode and concurrency x prompt tokens in the prefill
# queue, below the other pool's threshold. (A first prefill shape, 6 x 800-token prompts on a 4096-token
# decode cache, could reach the decode threshold: four prompts' KV, 78%, sat on decode at once, and upstream
# scaled decode, rightly by its rule.)
SHAPES: dict[str, dict[str, Any]] = {
    # Short prompts, long outputs: decode KV grows past the decode threshold; prompts never queue.
    "decode": {"concurrency": 16, "prompt_tokens": 2, "max_tokens": 600, "right_pool": "decode"},
    # Long prompts, two output tokens: prompts queue on the prefill engine; decode never holds enough KV.
    "prefill": {"concurrency": 8, "prompt_tokens": 600, "max_tokens": 2, "right_pool": "prefill"},
}


def upstream_ready() -> str | None:
    """Why upstream's planner cannot run here, or None."""
    if not UPSTREAM_PY.exists():
        return f"{UPSTREAM_PY.relative_to(REPO)} is missing: run `make upstream-planner-env` first"
    probe = subprocess.run(
        [
            str(UPSTREAM_PY),
            "-I",
            "-c",
            "import dynamo.planner.core.adapters, dynamo.planner as p; print(p.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["?"]
        return f"upstream's planner does not import ({tail[0]}): run `make upstream-planner-env`"
    if ".cache/upstream-planner/" not in probe.stdout.replace("\\", "/"):
        return f"dynamo.planner resolves to {probe.stdout.strip()}, not the unpacked 1.6.1 wheel"
    return None


def shape_bounds(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """The most a shape can put on each pool, against the thresholds: which pool can be triggered at all."""
    spec = SHAPES[shape]
    decode_kv_max = spec["concurrency"] * (spec["prompt_tokens"] + spec["max_tokens"])
    decode_kv_threshold = args.decode_kv_rate / 100 * args.decode_blocks * BLOCK_SIZE
    prefill_queue_max = spec["concurrency"] * spec["prompt_tokens"]
    return {
        "decode_kv_max": decode_kv_max,
        "decode_kv_threshold": round(decode_kv_threshold),
        "prefill_queue_max": prefill_queue_max,
        "prefill_queue_threshold": args.prefill_queue_tokens,
        "reachable": [
            pool
            for pool, ok in (
                ("prefill", prefill_queue_max >= args.prefill_queue_tokens),
                ("decode", decode_kv_max >= decode_kv_threshold),
            )
            if ok
        ],
    }


def planner_config(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Upstream 1.6.1's PlannerConfig: virtual connector, disagg, load-based scaling on our thresholds."""
    return {
        "environment": "virtual",
        "backend": "vllm",
        "mode": "disagg",
        "model_name": MODEL,
        "optimization_target": "load",
        "enable_load_scaling": True,
        "enable_throughput_scaling": False,
        "load_adjustment_interval_seconds": args.interval,
        "min_endpoint": 1,
        "max_gpu_budget": 4,
        "prefill_engine_num_gpu": 1,
        "decode_engine_num_gpu": 1,
        # Prefill: one full context of queued prompt tokens. Decode: args.decode_kv_rate % of the KV cache.
        "prefill_scale_up_queue_tokens": args.prefill_queue_tokens,
        "prefill_scale_down_queue_tokens": 0,
        "decode_scale_up_kv_rate": args.decode_kv_rate,
        "decode_scale_down_kv_rate": 0,
        # Off: its Prometheus port, the live dashboard (default 0.0.0.0:8080), the runtime configuration API
        # (default 127.0.0.1:9086): fixed ports. With both off and no interval, no HTML report is written.
        "metric_reporting_prometheus_port": 0,
        "live_dashboard_port": 0,
        "control_api_port": 0,
        "report_interval_hours": None,
        "report_output_dir": str(work / "planner-reports"),
    }


class Load:
    """``concurrency`` client threads, each streaming one completion after another until stopped."""

    def __init__(self, base_url: str, concurrency: int, prompt_tokens: int, max_tokens: int) -> None:
        self.base_url = base_url
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.stop_event = threading.Event()
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def start(self) -> float:
        started = time.time()
        for t in self.threads:
            t.start()
        return started

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=120)

    def _prompt(self, rng: random.Random) -> str:
        """Words the tiny model's tokenizer maps to one token each, shuffled so prompts share no prefix."""
        return " ".join(rng.choice(WORDS) for _ in range(self.prompt_tokens))

    def _run(self) -> None:
        rng = random.Random()
        while not self.stop_event.is_set():
            body = {
                "model": MODEL,
                "prompt": self._prompt(rng),
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
            }
            try:
                status, out = http_json(f"{self.base_url}/v1/completions", body, timeout=300)
            except (OSError, ValueError):
                status, out = 0, None
            if status == 200 and isinstance(out, dict):
                with self._lock:
                    self.done += 1
                    self.tokens += int(out.get("usage", {}).get("completion_tokens", 0))
            else:
                with self._lock:
                    self.failed += 1
                time.sleep(1.0)


class Observer:
    """``live_observer.py`` in our venv: the virtual connector's decisions, as a deployment reads them."""

    def __init__(self, namespace: str, env: dict[str, str], log_path: Path) -> None:
        self._err = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(OBSERVER), namespace],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.ready = threading.Event()
        self.decisions: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            row = json.loads(line)
            if row.get("ready"):
                self.ready.set()
            else:
                self.decisions.append(row)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        self._thread.join(5)
        self._err.close()


# What upstream's planner logs (in the wheel's dynamo/planner/): environment/metrics_provider/
# runtime_provider.py `_log_fpm`; core/load_scaling.py `_decode_easy_decision`, `_prefill_easy_decision`,
# `_advance_load_disagg`; core/base.py `_log_decision_summary`.
FPM_LINE = re.compile(r"FPM (prefill|decode) engine (\S+):dp(\d+): wall_time=([\d.]+)s")
DECODE_UTIL = re.compile(r"decode \S+:dp\d+: sched_kv=(\d+), queued_kv=(\d+), max_kv=(\d+), util=([\d.]+)")
PREFILL_QUEUE = re.compile(r"Load prefill \S+:dp\d+: queued=(\d+)")
SUMMARY = re.compile(r"\[summary\] (\w+) \| current: prefill=(\d+) decode=(\d+)")
TRACKER = re.compile(r"FPM tracker started for (\S+)")
DISAGG = re.compile(r"Load-based disagg scaling: prefill (\d+)->(\d+), decode (\d+)->(\d+)")


def planner_view(log: str) -> dict[str, Any]:
    """What upstream's planner saw and said, from its log."""
    seen: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    for pool, wid, _dp, wall in FPM_LINE.findall(log):
        row = seen[pool].setdefault(wid, {"samples": 0, "timing_samples": 0})
        row["samples"] += 1
        row["timing_samples"] += float(wall) > 0
    utils = [(int(s), int(q), int(m), float(u)) for s, q, m, u in DECODE_UTIL.findall(log)]
    queues = [int(q) for q in PREFILL_QUEUE.findall(log)]
    summaries = SUMMARY.findall(log)
    return {
        "trackers": TRACKER.findall(log),
        "fpm_samples": seen,
        "decode_max_kv": utils[-1][2] if utils else None,
        "decode_util_max": max((u[3] for u in utils), default=None),
        "prefill_queue_max": max(queues, default=None),
        "ticks": len(summaries),
        "actions": [s[0] for s in summaries if s[0] != "HOLD"],
        "decisions": [
            dict(zip(("prefill_from", "prefill", "decode_from", "decode"), map(int, d), strict=True))
            for d in DISAGG.findall(log)
        ],
        "errors": [line[:300] for line in log.splitlines() if "Traceback" in line or " ERROR " in line][:5],
    }


def published(metrics_url: str) -> dict[str, int | None]:
    """One worker's FPM counters (records published; idle heartbeats, counted apart), summed over dp ranks."""
    try:
        values = scrape(metrics_url)
    except (OSError, urllib.error.URLError):
        return {"records": None, "heartbeats": None}

    def total(name: str) -> int | None:
        picked = [v for k, v in values.items() if k.split("{", 1)[0] == name]
        return int(sum(picked)) if picked else None

    return {
        "records": total("dynamo_worker_fpm_published_total"),
        "heartbeats": total("dynamo_worker_fpm_heartbeats_total"),
    }


def run_plane(plane: str, model_dir: Path, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One plane: the stack once, then one trial per load shape (each: a planner and an etcd of its own)."""
    t0 = time.monotonic()
    ns = f"uplive-{plane}"
    pdir = work / plane
    file_kv = pdir / "discovery"
    file_kv.mkdir(parents=True)
    nats = EmbeddedNatsServer().start() if plane == "nats" else None
    env = base_env(file_kv, nats.url if nats else None, DYN_EVENT_PLANE=plane, DYN_NAMESPACE=ns)
    env.pop("DYN_FORWARDPASS_METRIC_PORT", None)
    env.pop("ETCD_ENDPOINTS", None)  # file discovery for the workers; etcd is the virtual connector's only
    procs: list[Proc] = []
    rows: list[dict[str, Any]] = []

    def say(msg: str) -> None:
        print(f"[{plane} {time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    try:
        http_port, p_metrics, d_metrics = free_port(), free_port(), free_port()
        base_url = f"http://127.0.0.1:{http_port}"
        common = ["--served-model-name", MODEL, "--namespace", ns, "--kv-transfer-config"]
        procs.append(start_frontend(http_port, env, pdir / "frontend.log"))
        procs.append(start_worker(
            model_dir, env, pdir / "prefill.log", *common, kv_transfer_config_json("kv_both"),
            "--disaggregation-mode", "prefill", "--metrics-port", str(p_metrics),
            "--max-num-batched-tokens", str(args.prefill_batch_tokens),
        ))  # fmt: skip
        procs.append(start_worker(
            model_dir, env, pdir / "decode.log", *common, kv_transfer_config_json("kv_both"),
            "--disaggregation-mode", "decode", "--metrics-port", str(d_metrics),
            "--num-gpu-blocks-override", str(args.decode_blocks),
            "--max-num-seqs", str(max(spec["concurrency"] for spec in SHAPES.values())),
        ))  # fmt: skip
        say("frontend + prefill + decode workers starting (tiny model, CPU)")
        wait_until(lambda: model_ready(base_url, MODEL), timeout=600, procs=procs)
        say("model ready behind the frontend")
        metrics = {
            "prefill": f"http://127.0.0.1:{p_metrics}/metrics",
            "decode": f"http://127.0.0.1:{d_metrics}/metrics",
        }
        for shape in args.shapes:
            rows.append(run_trial(plane, shape, ns, env, base_url, metrics, procs, pdir / shape, args, say))
    except Exception as exc:  # the stack failed: every shape of this plane fails, the next plane still runs
        done = {r["shape"] for r in rows}
        rows.extend(
            {"plane": plane, "shape": shape, "pass": False, "error": f"{type(exc).__name__}: {exc}"[:3000]}
            for shape in args.shapes
            if shape not in done
        )
    finally:
        for proc in reversed(procs):
            proc.stop()
        if nats is not None:
            nats.stop()
    for row in rows:
        row.update(plane_wall_s=round(time.monotonic() - t0, 1), logs=str(pdir))
    return rows


def run_trial(
    plane: str,
    shape: str,
    ns: str,
    env: dict[str, str],
    base_url: str,
    metrics: dict[str, str],
    stack: list[Proc],
    tdir: Path,
    args: argparse.Namespace,
    say: Any,
) -> dict[str, Any]:
    """Upstream's planner on the running stack: idle first, then the shape's load until the first decision."""
    t0 = time.monotonic()
    spec = SHAPES[shape]
    tdir.mkdir(parents=True)
    etcd = EmbeddedEtcd().start()  # a fresh virtual-connector state: no earlier trial's decision
    tenv = {**env, "ETCD_ENDPOINTS": etcd.url}
    planner: Proc | None = None
    observer: Observer | None = None
    load: Load | None = None
    result: dict[str, Any] = {
        "plane": plane,
        "shape": shape,
        "right_pool": spec["right_pool"],
        "bounds": shape_bounds(shape, args),
    }
    try:
        before = {pool: published(url) for pool, url in metrics.items()}
        planner_env = {k: v for k, v in tenv.items() if not k.startswith("PYTHON") or k == "PYTHONUNBUFFERED"}
        cfg = planner_config(args, tdir)
        planner = Proc(
            [str(UPSTREAM_PY), "-I", "-m", "dynamo.planner", "--config", json.dumps(cfg)],
            planner_env,
            tdir / "planner.log",
        )
        observer = Observer(ns, tenv, tdir / "observer.log")
        say(f"[{shape}] upstream 1.6.1 planner starting (isolated venv)")
        procs = [*stack, planner]
        log = planner.log

        def planner_ticking() -> bool:
            view = planner_view(log())
            return len(view["trackers"]) >= 2 and view["ticks"] >= 1

        wait_until(planner_ticking, timeout=180, procs=procs)
        if not observer.ready.wait(60):
            raise RuntimeError(f"the decision observer did not start: see {tdir / 'observer.log'}")
        say(f"[{shape}] planner ticking; watching {args.idle_s:.0f} s of idle first")
        time.sleep(args.idle_s)
        idle_decisions = list(observer.decisions)
        idle_ticks = planner_view(log())["ticks"]

        load = Load(base_url, spec["concurrency"], spec["prompt_tokens"], spec["max_tokens"])
        load_start = load.start()
        say(f"[{shape}] load: {spec['concurrency']} streams, prompts of {spec['prompt_tokens']} tokens, "
            f"{spec['max_tokens']} output tokens each")  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while not observer.decisions and time.monotonic() < deadline:
            for proc in procs:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.log_path.name} exited: {proc.log()[-2000:]}")
            time.sleep(0.25)
        first = observer.decisions[0] if observer.decisions else None
        if first:
            say(f"[{shape}] first decision: prefill {first['prefill']}, decode {first['decode']}")
            time.sleep(2 * args.interval)  # the planner's log lines for that tick
        else:
            say(f"[{shape}] no decision within {args.timeout:.0f} s of load")
        load.stop()
        load_s = time.time() - load_start
        after = {pool: published(url) for pool, url in metrics.items()}
        view = planner_view(log())
        result.update(
            published={pool: {k: _delta(after[pool][k], before[pool][k]) for k in ("records", "heartbeats")}
                       for pool in metrics},
            planner_saw=view["fpm_samples"],
            planner_trackers=view["trackers"],
            planner_ticks=view["ticks"],
            decode_max_kv=view["decode_max_kv"],
            decode_util_max=view["decode_util_max"],
            prefill_queue_max=view["prefill_queue_max"],
            planner_actions=view["actions"],
            planner_log_decisions=view["decisions"],
            planner_errors=view["errors"],
            idle_decisions=idle_decisions,
            idle_ticks=idle_ticks,
            first_decision=first,
            decision_after_s=round(first["t"] - load_start, 1) if first else None,
            load={"requests_done": load.done, "failed": load.failed, "tokens": load.tokens,
                  "seconds": round(load_s, 1)},
        )  # fmt: skip
        scaled = []
        if first:
            scaled = [pool for pool in ("prefill", "decode") if first[pool] > 1]
        result["scaled"] = scaled
        logged = view["decisions"][0] if view["decisions"] else None
        result["log_agrees"] = bool(
            first and logged and (logged["prefill"], logged["decode"]) == (first["prefill"], first["decode"])
        )
        result["pass"] = scaled == [spec["right_pool"]] and not idle_decisions and result["log_agrees"]
    except Exception as exc:  # reported per trial; the next one still runs
        result.update(error=f"{type(exc).__name__}: {exc}"[:3000], scaled=[])
        result["pass"] = False
    finally:
        if load is not None:
            load.stop_event.set()
        if planner is not None:
            planner.stop()
        if observer is not None:
            observer.stop()
        if load is not None:
            load.stop()
        etcd.stop()
        result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def print_table(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        wall = f" ({r['wall_s']:.0f} s)" if "wall_s" in r else ""
        print(f"\n== plane {r['plane']}, {r['shape']}-heavy load: {'PASS' if r['pass'] else 'FAIL'}{wall}")
        if r.get("error"):
            print(f"  error: {r['error']}")
            continue
        b = r["bounds"]
        print(f"  by construction: decode KV <= {b['decode_kv_max']} tokens "
              f"(threshold {b['decode_kv_threshold']}), "
              f"prefill queue <= {b['prefill_queue_max']} tokens (threshold {b['prefill_queue_threshold']}): "
              f"only {', '.join(b['reachable']) or 'nothing'} reachable")  # fmt: skip
        pub = r["published"]
        print("  records our workers published (dynamo_worker_fpm_published_total; + idle heartbeats): "
              f"prefill {pub['prefill']['records']} (+{pub['prefill']['heartbeats']}), "
              f"decode {pub['decode']['records']} (+{pub['decode']['heartbeats']})")  # fmt: skip
        for pool in ("prefill", "decode"):
            seen = r["planner_saw"][pool]
            per = ", ".join(f"{w}: {s['samples']} ({s['timing_samples']} timing)" for w, s in seen.items())
            print(f"  records upstream's planner sampled, {pool}: {per or 'none'}")
        print(f"  planner ticks {r['planner_ticks']} ({r['idle_ticks']} idle before the load, "
              f"decisions then: {len(r['idle_decisions'])})")  # fmt: skip
        util = r["decode_util_max"]
        print(f"  what it computed: decode KV utilization max {util if util is not None else '-'} of "
              f"max_kv {r['decode_max_kv']}; prefill queue max {r['prefill_queue_max']} tokens")  # fmt: skip
        first = r["first_decision"]
        if first:
            print(
                f"  first decision (virtual connector): prefill {first['prefill']}, decode {first['decode']} "
                f"after {r['decision_after_s']} s of load -> scaled {', '.join(r['scaled']) or 'nothing'} "
                f"(right: {r['right_pool']}); the planner's log agrees: {'yes' if r['log_agrees'] else 'NO'}"
            )
        else:
            print(f"  first decision: none (right: {r['right_pool']})")
        ld = r["load"]
        print(f"  load: {ld['requests_done']} requests done, {ld['failed']} failed, {ld['tokens']} tokens in "
              f"{ld['seconds']} s")  # fmt: skip
        if r["planner_errors"]:
            print(f"  planner errors: {r['planner_errors']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", default="nats,zmq", help="comma-separated: nats, zmq (default both)")
    parser.add_argument(
        "--shapes", default="decode,prefill", help="load shapes: decode, prefill (default both)"
    )
    parser.add_argument(
        "--decode-blocks",
        type=int,
        default=512,
        help="the decode worker's KV blocks of 32 tokens (--num-gpu-blocks-override, default 512)",
    )
    parser.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=256,
        help="the prefill worker's --max-num-batched-tokens (default 256)",
    )
    parser.add_argument(
        "--decode-kv-rate",
        type=float,
        default=40.0,
        help="upstream's decode_scale_up_kv_rate, percent of the KV cache (default 40)",
    )
    parser.add_argument(
        "--prefill-queue-tokens",
        type=int,
        default=2048,
        help="upstream's prefill_scale_up_queue_tokens (default 2048, one context)",
    )
    parser.add_argument("--interval", type=int, default=2, help="upstream's load_adjustment_interval_seconds")
    parser.add_argument("--idle-s", type=float, default=8.0, help="idle seconds watched before the load")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds of load to wait for a decision")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work folder (printed)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last stdout line")
    args = parser.parse_args(argv)  # fmt: skip
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if not planes or any(p not in PLANES for p in planes):
        parser.error(f"--planes takes {', '.join(PLANES)}")
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not args.shapes or any(s not in SHAPES for s in args.shapes):
        parser.error(f"--shapes takes {', '.join(SHAPES)}")
    for shape in args.shapes:
        bounds = shape_bounds(shape, args)
        if bounds["reachable"] != [SHAPES[shape]["right_pool"]]:
            print(
                f"warning: with these thresholds the {shape} shape can trigger "
                f"{bounds['reachable']}: {bounds}",
            )
    # A SIGTERM unwinds like Ctrl-C, through every `finally`: no worker, engine or server outlives the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if (why := upstream_ready()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from dynamo_fpm_testing.tiny_model import build_tiny_model

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="bench-upstream-live-")
    work = Path(tmp)
    try:
        model_dir = build_tiny_model(work / "model")
        for plane in planes:
            rows.extend(run_plane(plane, model_dir, work, args))
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    total = round(time.monotonic() - started, 1)
    verdicts = ", ".join(f"{r['plane']}/{r['shape']} {'PASS' if r['pass'] else 'FAIL'}" for r in rows)
    print(f"\n{verdicts}; total {total:.0f} s" + (f"; logs in {tmp}" if args.keep_logs else ""))
    if args.json:
        print(json.dumps({"trials": rows, "wall_s": total, "config": vars(args)}))
    return 0 if rows and all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
