"""Run one demo: start the stack, wait until it serves, drive the load with a live view, report, clean up.

Every failure path ends in ``Supervisor.stop_all()``: normal end, Ctrl-C/SIGTERM, a component that exits
on its own (named, with the last lines of its log), or a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import httpx

from . import stack
from .live_view import CLEAR, compact_status, render
from .load import LoadState, latency_summary, run_load
from .outcome import scaled_replica
from .report import ReportData, write_report
from .signals import Signals
from .supervisor import Failure, Supervisor
from .verdict import Verdict, judge

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TIMEOUT = 0, 1, 130, 3
STALL_WARN_S = 45.0  # no streamed token for this long while requests are in flight: say so


class ComponentFailed(RuntimeError):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


class StartupTimeout(RuntimeError):
    pass


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def nixl_available(python: str) -> bool:
    """Whether real NIXL disaggregation can run here (the ``nixl`` package imports)."""
    try:
        return subprocess.run([python, "-c", "import nixl"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class DemoRun:
    def __init__(
        self,
        cfg: stack.DemoConfig,
        *,
        run_id: str,
        out: TextIO = sys.stdout,
        live: bool | None = None,
        startup_timeout_s: float = 420.0,
        settle_timeout_s: float = 150.0,
        keep_running: bool = False,
        notes: list[str] | None = None,
        baseline: dict[str, object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.out = out
        self.live = out.isatty() if live is None else live
        self.startup_timeout_s = startup_timeout_s
        self.settle_timeout_s = settle_timeout_s
        self.keep_running = keep_running
        self.notes = list(notes or [])
        self.sup = Supervisor(cfg.run_dir, run_id)
        self.signals = Signals(cfg.fpm_path, cfg.decision_path, cfg.connector_events_path)
        # --compare: the summary of the same load run with the planner off, shown next to this run's.
        self.baseline = baseline
        self.load = LoadState()
        self.t0 = time.time()
        self._last_compact = 0.0
        self._stall_warned = False
        self.verdict: Verdict | None = None
        self.report_path: Path | None = None

    # ---- output --------------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)
        with open(self.cfg.run_dir / "demo.log", "a", encoding="utf-8") as fh:
            fh.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")

    def replicas(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for pool in ("prefill", "decode"):
            if pool == "prefill" and self.cfg.agg:
                continue
            r = self.signals.replicas(pool) if self.cfg.planner else None
            out[pool] = r if r is not None else self.cfg.minimum[pool]
        return out

    def tick(self, title: str = "dynamo-fpm demo") -> None:
        """Poll the recordings, fail fast on a dead component, refresh the view."""
        self.signals.poll()
        failure = self.sup.check()
        if failure is not None:
            raise ComponentFailed(failure)
        engines = self.signals.live_engines()
        stalled = self.load.stalled_for()
        if stalled >= STALL_WARN_S and not self._stall_warned:
            self._stall_warned = True
            self.say(
                f"WARNING: {self.load.in_flight} requests in flight but no token for {stalled:.0f} s: "
                "the stack looks stuck (KV transfer between prefill and decode?); "
                f"see {self.cfg.run_dir / 'logs'}"
            )
        elif stalled == 0.0 or self.load.last_token_at > time.time() - 5:
            self._stall_warned = False
        if self.live:
            screen = render(
                self.load,
                engines,
                self.signals.decisions,
                self.replicas(),
                self.t0,
                title,
                notes=self.notes
                + ([f"WARNING: no token for {stalled:.0f} s"] if stalled >= STALL_WARN_S else []),
                connector={p: self.signals.connector_counts(p) for p in self.replicas()},
            )
            self.out.write(CLEAR + screen + "\n")
            self.out.flush()
        elif time.time() - self._last_compact >= 10.0:
            self._last_compact = time.time()
            self.say(compact_status(self.load, self.replicas(), engines, self.t0))

    # ---- phases --------------------------------------------------------------------------------------
    def build_model(self) -> None:
        self.say(f"building the tiny model in {self.cfg.model_dir} ...")
        log = self.cfg.run_dir / "logs" / "model.log"
        with open(log, "ab") as fh:
            rc = subprocess.run(
                stack.model_argv(self.cfg), stdout=fh, stderr=subprocess.STDOUT, timeout=300
            ).returncode
        if rc != 0:
            raise ComponentFailed(Failure("model-builder", rc, log, log.read_text(errors="replace")[-2000:]))

    def start_stack(self) -> None:
        cfg, env = self.cfg, stack.stack_env(self.cfg)
        from dynamo_fpm_testing.nats_server import find_nats_server

        self.sup.start("nats", stack.nats_argv(cfg, find_nats_server()), env)
        self._wait_port(cfg.nats_port, "nats", 30)
        self.say(f"nats-server     {cfg.nats_url}")
        self.sup.start("fpm-watch", stack.watch_argv(cfg), env, stdout_path=cfg.fpm_path)
        self.sup.start("frontend", stack.frontend_argv(cfg), env)
        self.say(f"frontend        {cfg.base_url}  (OpenAI API)")
        if cfg.agg:
            self.sup.start("worker-agg", stack.worker_argv(cfg, "agg"), env)
            self.say("worker          1 aggregated (prefill+decode in one engine)")
        else:
            self.sup.start(
                "worker-prefill",
                stack.worker_argv(cfg, "prefill"),
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_side_channel_port())},
            )
            self.sup.start(
                "worker-decode",
                stack.worker_argv(cfg, "decode"),
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_side_channel_port())},
            )
            self.say("workers         1 prefill + 1 decode (vLLM NixlConnector over NIXL, CPU KV buffers)")

    def start_planner(self) -> None:
        c = self.cfg
        if not c.planner:
            self.say("planner         OFF (baseline run: the same load on the initial workers)")
            return
        self.sup.start("planner", stack.planner_argv(self.cfg), stack.stack_env(self.cfg))
        self.say(
            "planner         local connector, prefill "
            f"{c.minimum['prefill']}..{0 if c.agg else c.prefill_max}, "
            f"decode {c.decode_min}..{c.decode_max}, every {c.planner_interval_s:g} s"
            + (f", {c.decode_standby} warm decode standby" if c.decode_standby else "")
        )

    def _wait_port(self, port: int, name: str, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.3):
                return
            failure = self.sup.check()
            if failure:
                raise ComponentFailed(failure)
            time.sleep(0.1)
        raise StartupTimeout(f"{name} did not listen on port {port} within {timeout:.0f} s")

    def wait_ready(self) -> None:
        """Until the frontend says the model is ready (every needed worker type present)."""
        url = f"{self.cfg.base_url}/v1/models/{self.cfg.served_model_name}/ready"
        start = time.monotonic()
        self.say("waiting for the workers to load the model (20-110 s on 2 cores) ...")
        with httpx.Client(timeout=2.0) as client:

            def ready() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return client.get(url).status_code == 200
                return False

            self._wait_for(
                ready,
                start,
                done="model ready",
                waiting="still starting",
                timeout_what=f"the model was not ready after {self.startup_timeout_s:.0f} s; see the logs in "
                f"{self.cfg.run_dir / 'logs'}",
            )
        self.wait_standby(start)

    def _wait_for(
        self, done_yet: Callable[[], bool], start: float, *, done: str, waiting: str, timeout_what: str
    ) -> None:
        """Poll once a second: the planner's signals read first, then ``done_yet``; a failed component or
        the startup timeout raised, a progress line every 15 s."""
        last_msg = 0.0
        while True:
            waited = time.monotonic() - start
            self.signals.poll()
            if done_yet():
                self.say(f"{done} after {waited:.0f} s")
                return
            failure = self.sup.check()
            if failure is not None:
                raise ComponentFailed(failure)
            if waited > self.startup_timeout_s:
                raise StartupTimeout(timeout_what)
            if waited - last_msg >= 15:
                last_msg = waited
                self.say(f"  ... {waiting} ({waited:.0f} s)")
            time.sleep(1.0)

    def standby_warm(self) -> int:
        counts = self.signals.connector_counts("decode")
        return counts.get("standby", 0) if counts else 0

    def wait_standby(self, start: float) -> None:
        """Until the planner's decode standby is loaded (the burst must find it warm)."""
        want = self.cfg.decode_standby if self.cfg.planner else 0
        if want <= 0:
            return
        self.say(f"waiting for the planner's {want} decode standby to load (warm, not registered) ...")

        self._wait_for(
            lambda: self.standby_warm() >= want,
            start,
            done="decode standby warm",
            waiting="standby still loading",
            timeout_what=f"the planner's decode standby was not warm after {self.startup_timeout_s:.0f} s; "
            f"see {self.cfg.run_dir / 'logs'} (planner.log, decode-*.log)",
        )

    async def drive(self) -> None:
        phases = stack.load_phases(self.cfg.duration_s, self.cfg.intensity)
        self.say("load: " + ", ".join(f"{p.name} {p.duration_s:.0f} s x{p.concurrency}" for p in phases))
        task = asyncio.create_task(
            run_load(
                self.cfg.base_url, self.cfg.served_model_name, phases, self.load, on_phase=self._on_phase
            )
        )
        try:
            while not task.done():
                self.tick()
                await asyncio.wait({task}, timeout=1.0)
            task.result()
            # Settle: keep watching until both pools are back at their minimum (or the timeout).
            deadline = time.monotonic() + self.settle_timeout_s
            while self.cfg.planner and time.monotonic() < deadline and not self._at_minimum():
                self.load.phase = "settle"
                self.tick()
                await asyncio.sleep(1.0)
            self.tick()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _on_phase(self, phase: object) -> None:
        if not self.live:
            self.say(f"phase: {getattr(phase, 'name', phase)}")

    def _at_minimum(self) -> bool:
        reps = self.replicas()
        return all((reps.get(p) or 0) <= self.cfg.minimum[p] for p in reps)

    def finish(self) -> None:
        """Verdict, request log, report."""
        self.signals.poll()
        burst = next((p for p in self.load.phase_times if p[0] == "burst"), None)
        b0, b1 = (burst[1], burst[2]) if burst else (self.t0, time.time())
        scaled = scaled_replica(self.signals.samples, self.signals.decisions, self.signals.events, b0, b1)
        self.verdict = judge(self.signals.decisions, b0, b1, self.cfg.minimum, scaled=scaled)
        with open(self.cfg.run_dir / "requests.jsonl", "w", encoding="utf-8") as fh:
            for r in self.load.results:
                fh.write(json.dumps(asdict(r)) + "\n")
        settings = {
            k: str(v) if isinstance(v, Path) else v
            for k, v in asdict(self.cfg).items()
            if k not in ("python", "extra_env")
        }
        data = ReportData(
            t0=self.t0,
            samples=self.signals.samples,
            decisions=self.signals.decisions,
            results=self.load.results,
            phase_times=self.load.phase_times,
            verdict=self.verdict,
            minimum=self.cfg.minimum,
            settings=settings,
            notes=self.notes,
            events=self.signals.events,
            planner=self.cfg.planner,
            baseline=self.baseline,
        )
        self.report_path = write_report(data, self.cfg.run_dir / "report")
        v = self.verdict
        latency = latency_summary(self.load.results)
        summary: dict[str, object] = {
            "planner": self.cfg.planner,
            "passed": v.passed if self.cfg.planner else None,
            "lines": list(v.lines),
            "decode_scaled_up": v.decode_scaled_up,
            "decode_up_after_s": v.decode_up_after_s,
            "decode_peak": v.decode_peak,
            "prefill_scaled_up": v.prefill_scaled_up,
            "wrong_pool_actions": len(v.wrong_pool_actions),
            "returned_to_min": v.returned_to_min,
            "final_replicas": v.final_replicas,
            "scaled_replica_took_load": v.took_load,
            "scaled_replica_worker": scaled.worker_id,
            "scaled_replica_serving_s": scaled.serving_s,
            "scaled_replica_first_work_s": scaled.first_work_s,
            "scaled_replica_decode_share": scaled.decode_share,
            "burst": [b0, b1],
            "latency": latency,
            "report": str(self.report_path),
        }
        if self.baseline is not None:
            summary["compare"] = {"planner_off": self.baseline}
        (self.cfg.run_dir / "verdict.json").write_text(json.dumps(summary, indent=2, default=str))
        self.say("")
        self.say(f"report: {self.report_path}")
        if not self.cfg.planner:
            self.say("planner off (baseline): " + burst_line(latency))
            return
        self.say("verdict:")
        for line in v.lines:
            self.say(f"  {line}")
        if self.baseline is not None:
            base = self.baseline.get("latency", {})
            self.say("compare (same load):")
            self.say(f"  planner on:  {burst_line(latency)}")
            self.say(f"  planner off: {burst_line(base if isinstance(base, dict) else {})}")

    def hold_open(self) -> None:
        """``--keep-running``: leave the stack up until Ctrl-C."""
        c = self.cfg
        self.say("")
        self.say("the stack keeps running (Ctrl-C to stop everything). Try:")
        self.say(
            f"  curl -s {c.base_url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model":"{c.served_model_name}","prompt":"the a of","max_tokens":16}}\''
        )
        self.say(
            f"  NATS_SERVER={c.nats_url} {c.python} -m dynamo.common.recv_forward_pass_metrics --namespace "
            f"{c.namespace}"
        )
        self.say(f"  tail -f {c.run_dir / 'logs'}/*.log")
        while True:
            failure = self.sup.check()
            if failure is not None:
                raise ComponentFailed(failure)
            time.sleep(1.0)

    # ---- the whole run -------------------------------------------------------------------------------
    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)
        rc = EXIT_OK
        try:
            self.say(f"run folder: {self.cfg.run_dir}")
            for note in self.notes:
                self.say(f"NOTE: {note}")
            self.build_model()
            self.start_stack()
            self._wait_port(self.cfg.http_port, "frontend", 60)
            self.start_planner()
            self.wait_ready()
            self.t0 = time.time()
            asyncio.run(self.drive())
            self.finish()
            if self.keep_running:
                self.hold_open()
        except ComponentFailed as exc:
            rc = EXIT_FAILED
            self.say("")
            self.say(f"FAILED: {exc}")
        except StartupTimeout as exc:
            rc = EXIT_TIMEOUT
            self.say(f"TIMEOUT: {exc}")
            self._show_tails()
        except KeyboardInterrupt:
            rc = EXIT_INTERRUPTED
            self.say("\ninterrupted: stopping every process ...")
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no second interrupt during cleanup
            try:
                if rc != EXIT_OK and self.verdict is None and self.load.results:
                    with contextlib.suppress(Exception):
                        self.finish()
                self.cleanup()
            finally:
                signal.signal(signal.SIGTERM, previous)
        return rc

    def _show_tails(self) -> None:
        from .supervisor import tail_lines

        for m in self.sup.procs:
            self.say(f"--- last lines of {m.log_path.name} ---")
            self.say(tail_lines(m.log_path, 8))

    def cleanup(self) -> None:
        self.say("stopping the stack ...")
        stragglers = self.sup.stop_all(timeout=30.0)
        (self.cfg.run_dir / "processes.json").write_text(
            json.dumps(
                {
                    "run_id": self.sup.run_id,
                    "processes": [
                        {"name": m.name, "pid": m.pid, "returncode": m.proc.returncode}
                        for m in self.sup.procs
                    ],
                    "killed_by_marker_scan": stragglers,
                },
                indent=2,
            )
        )
        self.say(f"all processes stopped; logs in {self.cfg.run_dir / 'logs'}")


def burst_line(latency: Mapping[str, Mapping[str, object]]) -> str:
    """The burst's requests, tokens and latency percentiles in one line."""
    b = latency.get("burst") or {}

    def ms(key: str) -> str:
        v = b.get(key)
        return f"{float(v) * 1000:.0f} ms" if isinstance(v, int | float) else "-"

    return (
        f"burst {b.get('requests', 0)} requests, {b.get('tokens', 0)} tokens; TTFT p50 {ms('ttft_p50')} "
        f"p90 {ms('ttft_p90')}; ITL p50 {ms('itl_p50')} p90 {ms('itl_p90')}"
    )


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted()


def _free() -> int:
    from dynamo.common.ports import free_port

    return free_port()


def _side_channel_port() -> int:
    """Bound only after the engine loaded its model: outside the ephemeral range (dynamo.common.ports)."""
    from dynamo.common.ports import stable_free_port

    return stable_free_port()


def make_config(run_dir: Path, **kw: Any) -> stack.DemoConfig:
    return stack.DemoConfig(
        run_dir=run_dir,
        model_dir=run_dir / "model",
        discovery_dir=run_dir / "discovery",
        nats_port=_free(),
        http_port=_free(),
        **kw,
    )
