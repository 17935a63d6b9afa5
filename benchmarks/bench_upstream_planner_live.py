"""Benchmark: upstream Dynamo 1.6.1's own planner, live, scales the right pool from our workers' FPM records.

    .venv/bin/python benchmarks/bench_upstream_planner_live.py [--planes nats,zmq] [--json]
    make bench-upstream-live

Per event plane, real processes on free loopback ports: etcd (upstream's virtual connector keeps its
decision there), NATS (only for the ``nats`` plane), Dynamo's frontend, our ``python -m dynamo.vllm`` as a
disaggregated pair on the tiny model (prefill pool = component ``prefill``, decode pool = ``backend``, file
discovery), and upstream's planner ``python -m dynamo.planner`` from its isolated venv
(``benchmarks/upstream_planner/README.md``): ``environment: virtual``, ``mode: disagg``, load-based
scaling with ``optimization_target: load`` (a prefill-queue and a decode-KV threshold of our choosing). The
load is decode-heavy: short prompts, long outputs, a few concurrent streams through the frontend. The right
answer is "one more decode worker, prefill unchanged". The decision is read where a deployment environment
reads it (``VirtualConnectorClient``, ``upstream_planner/live_observer.py``) and cross-checked in the
planner's log. Nothing starts the extra worker (a 2-core machine): the first decision is the result.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The test helpers this benchmark uses, in one place (tests/ is being reorganized: repoint here).
sys.path.insert(0, str(REPO / "tests"))

from dynamo.common.nats_server import EmbeddedNatsServer  # noqa: E402
from dynamo.common.ports import free_port  # noqa: E402
from planner_support import EmbeddedEtcd  # noqa: E402
from worker_support import (  # noqa: E402
    Proc,
    base_env,
    kv_transfer_config_json,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    wait_until,
)

UPSTREAM_PY = REPO / ".cache" / "upstream-planner" / "venv" / "bin" / "python"
OBSERVER = REPO / "benchmarks" / "upstream_planner" / "live_observer.py"
MODEL = "tiny"
BLOCK_SIZE = 32  # worker_support.ENGINE_FLAGS
PLANES = ("nats", "zmq")


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
        # (default 127.0.0.1:9086) and the HTML report: fixed ports and CPU this benchmark does not want.
        "metric_reporting_prometheus_port": 0,
        "live_dashboard_port": 0,
        "control_api_port": 0,
        "report_interval_hours": None,
        "report_output_dir": str(work / "planner-reports"),
    }


class Load:
    """``concurrency`` client threads, each streaming one completion after another until stopped."""

    def __init__(self, base_url: str, concurrency: int, max_tokens: int) -> None:
        self.base_url = base_url
        self.body = {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}
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

    def _run(self) -> None:
        data = json.dumps(self.body).encode()
        while not self.stop_event.is_set():
            req = urllib.request.Request(
                f"{self.base_url}/v1/completions", data=data, headers={"content-type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    out = json.loads(resp.read())
                tokens = int(out.get("usage", {}).get("completion_tokens", 0))
                with self._lock:
                    self.done += 1
                    self.tokens += tokens
            except (OSError, ValueError):
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
        import os
        import signal

        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
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


def run_plane(
    plane: str, model_dir: Path, etcd: EmbeddedEtcd, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One plane, start to stop: the stack, upstream's planner, the load, the first decision."""
    t0 = time.monotonic()
    ns = f"uplive-{plane}"
    pdir = work / plane
    file_kv = pdir / "discovery"
    file_kv.mkdir(parents=True)
    nats = EmbeddedNatsServer().start() if plane == "nats" else None
    env = base_env(
        file_kv,
        nats.url if nats else None,
        DYN_EVENT_PLANE=plane,
        DYN_NAMESPACE=ns,
        ETCD_ENDPOINTS=etcd.url,
    )
    env.pop("DYN_FORWARDPASS_METRIC_PORT", None)
    procs: list[Proc] = []
    observer: Observer | None = None
    load: Load | None = None
    result: dict[str, Any] = {"plane": plane, "namespace": ns}

    def say(msg: str) -> None:
        print(f"[{plane} {time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    try:
        http_port, p_metrics, d_metrics = free_port(), free_port(), free_port()
        base_url = f"http://127.0.0.1:{http_port}"
        common = ["--served-model-name", MODEL, "--namespace", ns, "--kv-transfer-config"]
        procs.append(start_frontend(http_port, env, pdir / "frontend.log"))
        prefill = start_worker(
            model_dir, env, pdir / "prefill.log", *common, kv_transfer_config_json("kv_both"),
            "--disaggregation-mode", "prefill", "--metrics-port", str(p_metrics),
        )  # fmt: skip
        procs.append(prefill)
        decode = start_worker(
            model_dir, env, pdir / "decode.log", *common, kv_transfer_config_json("kv_both"),
            "--disaggregation-mode", "decode", "--metrics-port", str(d_metrics),
            "--num-gpu-blocks-override", str(args.decode_blocks), "--max-num-seqs", str(args.concurrency),
        )  # fmt: skip
        procs.append(decode)
        say("frontend + prefill + decode workers starting (tiny model, CPU)")
        wait_until(lambda: model_ready(base_url, MODEL), timeout=600, procs=procs)
        say("model ready behind the frontend")

        planner_env = {k: v for k, v in env.items() if not k.startswith("PYTHON") or k == "PYTHONUNBUFFERED"}
        cfg = planner_config(args, pdir)
        planner = Proc(
            [str(UPSTREAM_PY), "-I", "-m", "dynamo.planner", "--config", json.dumps(cfg)],
            planner_env,
            pdir / "planner.log",
        )
        procs.append(planner)
        observer = Observer(ns, env, pdir / "observer.log")
        say("upstream 1.6.1 planner starting (isolated venv)")

        def planner_ticking() -> bool:
            view = planner_view(planner.log())
            return len(view["trackers"]) >= 2 and view["ticks"] >= 1

        wait_until(planner_ticking, timeout=180, procs=procs)
        if not observer.ready.wait(60):
            raise RuntimeError(f"the decision observer did not start: see {pdir / 'observer.log'}")
        say(f"planner ticking; watching {args.idle_s:.0f} s of idle first")
        time.sleep(args.idle_s)
        idle_decisions = list(observer.decisions)
        idle_view = planner_view(planner.log())

        load = Load(base_url, args.concurrency, args.max_tokens)
        load_start = load.start()
        say(f"load: {args.concurrency} streams of short prompts, {args.max_tokens} output tokens each")
        deadline = time.monotonic() + args.timeout
        while not observer.decisions and time.monotonic() < deadline:
            for proc in procs:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.log_path.name} exited: {proc.log()[-2000:]}")
            time.sleep(0.25)
        first = observer.decisions[0] if observer.decisions else None
        if first:
            say(f"first decision: prefill {first['prefill']}, decode {first['decode']}")
            time.sleep(2 * args.interval)  # the planner's log lines for that tick
        else:
            say(f"no decision within {args.timeout:.0f} s of load")
        load.stop()
        load_s = time.time() - load_start
        view = planner_view(planner.log())
        result.update(
            published={"prefill": published(f"http://127.0.0.1:{p_metrics}/metrics"),
                       "decode": published(f"http://127.0.0.1:{d_metrics}/metrics")},
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
            idle_ticks=idle_view["ticks"],
            first_decision=first,
            decision_after_s=round(first["t"] - load_start, 1) if first else None,
            load={"requests_done": load.done, "failed": load.failed, "tokens": load.tokens,
                  "seconds": round(load_s, 1)},
        )  # fmt: skip
        scaled = []
        if first:
            if first["prefill"] > 1:
                scaled.append("prefill")
            if first["decode"] > 1:
                scaled.append("decode")
        result["scaled"] = scaled
        logged = view["decisions"][0] if view["decisions"] else None
        result["log_agrees"] = bool(
            first and logged and (logged["prefill"], logged["decode"]) == (first["prefill"], first["decode"])
        )
        result["pass"] = scaled == ["decode"] and not idle_decisions and result["log_agrees"]
    except Exception as exc:  # reported per plane; the other plane still runs
        result.update(error=f"{type(exc).__name__}: {exc}"[:3000], scaled=[])
        result["pass"] = False
    finally:
        if load is not None:
            load.stop_event.set()
        for proc in reversed(procs):
            proc.stop()
        if observer is not None:
            observer.stop()
        if load is not None:
            load.stop()
        if nats is not None:
            nats.stop()
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["logs"] = str(pdir)
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"\n== plane {r['plane']}: {'PASS' if r['pass'] else 'FAIL'} ({r['wall_s']:.0f} s)")
        if r.get("error"):
            print(f"  error: {r['error']}")
            continue
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
        print(f"  decode KV utilization the planner computed, max {util if util is not None else '-'} of "
              f"max_kv {r['decode_max_kv']}; prefill queue max {r['prefill_queue_max']} tokens")  # fmt: skip
        first = r["first_decision"]
        if first:
            print(
                f"  first decision (virtual connector): prefill {first['prefill']}, decode {first['decode']} "
                f"after {r['decision_after_s']} s of load -> scaled {', '.join(r['scaled']) or 'nothing'}; "
                f"the planner's log agrees: {'yes' if r['log_agrees'] else 'NO'}"
            )
        else:
            print("  first decision: none")
        ld = r["load"]
        print(f"  load: {ld['requests_done']} requests done, {ld['failed']} failed, {ld['tokens']} tokens in "
              f"{ld['seconds']} s")  # fmt: skip
        if r["planner_errors"]:
            print(f"  planner errors: {r['planner_errors']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", default="nats,zmq", help="comma-separated: nats, zmq (default both)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent client streams (default 8)")
    parser.add_argument("--max-tokens", type=int, default=400, help="output tokens per request (default 400)")
    parser.add_argument(
        "--decode-blocks",
        type=int,
        default=128,
        help="the decode worker's KV blocks of 32 tokens (--num-gpu-blocks-override, default 128)",
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
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds of load to wait for a decision")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work folder (printed)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last stdout line")
    args = parser.parse_args(argv)  # fmt: skip
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if not planes or any(p not in PLANES for p in planes):
        parser.error(f"--planes takes {', '.join(PLANES)}")
    if (why := upstream_ready()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from dynamo.vllm.tiny_model import build_tiny_model

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="bench-upstream-live-")
    work = Path(tmp)
    try:
        model_dir = build_tiny_model(work / "model")
        etcd = EmbeddedEtcd().start()
        try:
            for plane in planes:
                rows.append(run_plane(plane, model_dir, etcd, work, args))
        finally:
            etcd.stop()
    finally:
        if not args.keep_logs:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    total = round(time.monotonic() - started, 1)
    print(f"\ntotal {total:.0f} s" + (f"; logs in {tmp}" if args.keep_logs else ""))
    if args.json:
        print(json.dumps({"planes": rows, "wall_s": total, "config": vars(args)}))
    return 0 if rows and all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
