"""``python -m dynamo.vllm``: a vLLM engine served behind Dynamo's frontend, publishing FPM.

Startup: parse and validate (exit 2 on bad arguments, before anything starts), choose the scheduler,
let vLLM validate its whole config, then the stages of :func:`serve` (:class:`WorkerRun`): the engine
processes' environment, the NATS check, the Dynamo runtime and the generate endpoint, the FPM environment
(worker id = the endpoint's connection id), metrics, the engine, standby, serve and register, report
ready. With ``--standby`` the worker waits, loaded and unregistered, for SIGUSR1 before it serves and
registers, and SIGHUP parks it again (``standby.py``). Shutdown on SIGTERM/SIGINT: drain (see
``drain.py``), stop the engine, stop the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from dynamo.common import worker_state as ws
from dynamo.common.cli_setup import loopback_by_default, setup_logging
from dynamo.common.ports import stable_free_port
from dynamo.vllm import engine as eng
from dynamo.vllm import engine_hooks, kv_events, registration
from dynamo.vllm.args import WorkerConfig, fail, parse_args
from dynamo.vllm.cpu_host import env_defaults, shm_wait
from dynamo.vllm.drain import DRAIN_SETTLE_S, DrainReport, ExitCode, InflightTracker, drain, held_kv_reader
from dynamo.vllm.fpm_env import ENV_STATS_FILE
from dynamo.vllm.fpm_metrics import WorkerCollector, WorkerMetrics
from dynamo.vllm.fpm_relay import ENV_FPM_PORT, fpm_zmq_port, start_relays, stop_relays
from dynamo.vllm.handlers import RequestHandler
from dynamo.vllm.health import (
    HEALTH_CHECK_PAYLOAD,
    Readiness,
    gate_on_transport,
    transport_health_from_env,
    wait_engine_dead,
)
from dynamo.vllm.runtime_workarounds import file_discovery_reaper
from dynamo.vllm.runtime_workarounds.file_discovery_keepalive import FileDiscoveryKeepAlive, start_for_worker
from dynamo.vllm.standby import StandbyControl, early_options, gate_path

log = logging.getLogger("dynamo.vllm")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


def nats_reachable(url: str, timeout_s: float = 2.0) -> bool:
    """TCP check of NATS_SERVER: the runtime would otherwise retry for up to 120 s."""
    first = url.split(",")[0].strip()
    parsed = urlparse(first if "://" in first else f"nats://{first}")
    try:
        with socket.create_connection((parsed.hostname or "localhost", parsed.port or 4222), timeout_s):
            return True
    except OSError:
        return False


def prepare(config: WorkerConfig) -> Any:
    """Scheduler choice and vLLM's own validation of the engine config; exit 2 on any problem."""
    choice = eng.choose_scheduler(
        config.scheduler_cls, config.fpm_enabled, eng.instrumented_scheduler_available()
    )
    if choice.warning:
        log.warning(choice.warning)
    config.fpm_enabled = choice.fpm_enabled
    config.engine_args.scheduler_cls = choice.scheduler_cls
    try:
        return eng.create_vllm_config(config.engine_args)
    except Exception as exc:
        fail(_one_line(exc))


def export_engine_environment(config: WorkerConfig) -> None:
    """Stage 1: the defaults a prefill or decode worker gives its engine processes (they inherit them)."""
    disagg_env = eng.disaggregation_environment(
        config.disaggregation_mode, dict(os.environ), stable_free_port(), cpu_platform=eng.is_cpu_platform()
    )
    for name, why in env_defaults.REASONS.items():
        if name in disagg_env:
            log.info("%s=%s: %s", name, disagg_env[name], why)
    os.environ.update(disagg_env)


def nats_ok(config: WorkerConfig) -> bool:
    """Stage 2: NATS must answer when the event or request plane uses it (one error line if not)."""
    nats = os.environ.get("NATS_SERVER", "")
    needs_nats = config.event_plane == "nats" or config.request_plane == "nats"
    if needs_nats and not nats_reachable(nats or "nats://localhost:4222"):
        log.error("NATS_SERVER %r is not reachable (needed by the nats event/request plane)", nats)
        print(f"dynamo.vllm: error: NATS_SERVER {nats!r} is not reachable", file=sys.stderr)
        return False
    return True


class WorkerRun:
    """One run of the worker, stage by stage: runtime, FPM environment, metrics, engine, standby, serving,
    drain, clean-up. The stages share the state below; :func:`serve` calls them in order."""

    def __init__(
        self, config: WorkerConfig, vllm_config: Any, control: StandbyControl, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.control = control
        self.loop = loop
        self.stop = asyncio.Event()
        self.transport_mode, self.transport_grace = transport_health_from_env(os.environ)  # checked by main()
        self.tracker = InflightTracker()
        self.runtime: Any = None
        self.endpoint: Any = None
        self.readiness: Readiness | None = None
        self.worker_id = ""
        self.stats_dir: str | None = None
        self.fpm_env: dict[str, str] = {}
        self.fpm_port: int | None = None  # the ZMQ event plane's port, None: the engine publishes on NATS
        self.relays: list[Any] = []
        self.kv_plan = kv_events.KvEventPlan((), "the engine has not started")
        self.kv_publishers: list[Any] = []
        self.held_kv: Callable[[float], int | None] | None = None
        self.metrics: WorkerMetrics | None = None
        self.gate: asyncio.Task[None] | None = None
        self.engine: Any = None
        self.handler: RequestHandler | None = None
        self.capacity: Any = None
        self.model_path = ""
        self.keepalive: FileDiscoveryKeepAlive | None = None
        self.reaper: file_discovery_reaper.DeadPeerReaper | None = None
        self.serve_task: asyncio.Future[Any] | None = None
        self.stop_wait: asyncio.Task[Any] | None = None
        self.dead_wait: asyncio.Task[Any] | None = None
        self.registered = False

    # ---- stages before the engine ----------------------------------------------------------------------
    def handle_signals(self) -> None:
        """SIGTERM/SIGINT end the run (drain first); the standby control gets its own signals."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop.set)
        self.control.standby, self.control.state_file = self.config.standby, self.config.state_file
        self.control.attach(self.loop)

    def connect_runtime(self) -> None:
        """The Dynamo runtime, the generate endpoint and the worker id (the endpoint's connection id)."""
        from dynamo.runtime import DistributedRuntime

        config = self.config
        self.runtime = DistributedRuntime(
            self.loop, config.discovery_backend, config.request_plane, event_plane=config.event_plane
        )
        self.readiness = Readiness(self.runtime)
        self.readiness.set(False)
        self.endpoint = self.runtime.endpoint(config.endpoint_path)
        self.worker_id = str(self.endpoint.connection_id())
        self.control.worker_id = self.worker_id

    def export_fpm_environment(self) -> bool:
        """What the InstrumentedScheduler reads in the engine process, and the engine hooks' owner pid; False
        (said on stderr) when the ZMQ event plane's port is unusable."""
        config = self.config
        self.stats_dir = eng.make_stats_dir()
        try:
            self.fpm_port = fpm_zmq_port(config.event_plane, config.fpm_enabled, os.environ)
        except ValueError as exc:
            print(f"dynamo.vllm: error: {exc}", file=sys.stderr)
            return False
        if self.fpm_port is None:
            os.environ.pop(ENV_FPM_PORT, None)  # the engine publishes on NATS directly
        if config.standby:  # no FPM heartbeats until registered: a standby is no pool member
            self.control.gate_file = gate_path(self.stats_dir)
        gate_file = str(self.control.gate_file) if self.control.gate_file else None
        self.fpm_env = eng.fpm_environment(
            config,
            self.worker_id,
            config.fpm_enabled,
            self.stats_dir,
            zmq_port=self.fpm_port,
            gate_file=gate_file,
        )
        os.environ.update(self.fpm_env)
        # For the engine processes' hooks (engine_hooks): they end with this process, and act only below it.
        os.environ[engine_hooks.WORKER_PID_ENV] = str(os.getpid())
        log.info(
            "worker %s serving %s (%s mode), FPM %s",
            self.worker_id,
            config.endpoint_path,
            config.disaggregation_mode,
            f"on ({config.event_plane} event plane)" if config.fpm_enabled else "off",
        )
        return True

    def start_metrics(self) -> None:
        """The worker's Prometheus metrics (runtime endpoint and optional port) and the transport gate."""
        config = self.config
        assert self.readiness is not None
        # A prefill engine holds each prompt's KV blocks until a decode worker has read them: the drain waits
        # for that.
        if config.disaggregation_mode == "prefill":
            if config.fpm_enabled:
                self.held_kv = held_kv_reader(self.fpm_env[ENV_STATS_FILE])
            else:
                log.warning(
                    "FPM is off: a drain cannot see the KV blocks held for decode workers and will not wait"
                )
        tracker = self.tracker
        collector = WorkerCollector(
            self.fpm_env[ENV_STATS_FILE] if config.fpm_enabled else None,
            lambda: tracker.count,
            self.readiness,
            {
                "dynamo_namespace": config.namespace,
                "dynamo_component": config.component,
                "dynamo_endpoint": config.endpoint,
                "worker_id": self.worker_id,
            },
        )
        self.metrics = WorkerMetrics(collector)
        with contextlib.suppress(Exception):
            self.endpoint.metrics.register_prometheus_expfmt_callback(self.metrics.expfmt)
        if config.metrics_port is not None:
            port = self.metrics.serve(config.metrics_port, host=config.metrics_host)
            log.info("Prometheus metrics on port %d (%s)", port, config.metrics_host)
        if self.transport_mode == "gate" and config.fpm_enabled:
            self.gate = self.loop.create_task(
                gate_on_transport(self.readiness, collector.health, grace_s=self.transport_grace)
            )

    # ---- the engine and serving ------------------------------------------------------------------------
    def start_engine(self) -> bool:
        """Start vLLM's engine and the request handler; False (logged) when the engine fails to start."""
        config = self.config
        try:
            self.engine = eng.start_engine(self.vllm_config, config.engine_args)
        except Exception as exc:
            log.error("engine failed to start: %s", _one_line(exc))
            print(f"dynamo.vllm: error: engine failed to start: {_one_line(exc)}", file=sys.stderr)
            return False
        engine = self.engine
        local_engines = eng.summed_engines(engine.vllm_config.parallel_config, engine)
        self.capacity = eng.engine_capacity(engine.vllm_config, local_engines)
        if self.fpm_port is not None:  # after the engine start: its PUB sockets are bound by now
            start = self.capacity.data_parallel_start_rank
            self.relays = start_relays(self.endpoint, self.fpm_port, range(start, start + local_engines))
        self.plan_kv_events(local_engines)
        model_config = engine.vllm_config.model_config
        self.handler = RequestHandler(
            engine,
            config.disaggregation_mode,
            self.tracker,
            self.capacity.context_length,
            model_config.get_diff_sampling_param(),
            self.capacity.data_parallel_start_rank,
            self.capacity.data_parallel_size,
        )
        self.model_path = (
            config.model
            if not os.path.isdir(os.path.expanduser(config.model))
            else os.path.abspath(os.path.expanduser(config.model))
        )
        self.stop_wait = self.loop.create_task(self.stop.wait())
        self.dead_wait = self.loop.create_task(wait_engine_dead(engine))
        return True

    def plan_kv_events(self, local_engines: int) -> None:
        """Which of vLLM's KV event sockets the worker relays (upstream's conditions); one line when none, and
        one WARNING for a socket where nothing listens (the worker serves without it)."""
        vllm_config = self.engine.vllm_config
        start = self.capacity.data_parallel_start_rank
        self.kv_plan = kv_events.plan(
            getattr(vllm_config, "kv_events_config", None),
            bool(vllm_config.cache_config.enable_prefix_caching),
            start,
            local_engines,
        )
        if not self.kv_plan.sources:
            log.info("KV events off: %s (the KV router sees no blocks of this worker)", self.kv_plan.reason)
            return
        missing = kv_events.missing_sources(self.kv_plan.sources)
        kv_events.report_missing(missing)
        live = tuple(source for source in self.kv_plan.sources if source not in missing)
        self.kv_plan = kv_events.KvEventPlan(live, "" if live else "vLLM's KV event socket is not listening")

    def start_kv_events(self) -> None:
        """Relay vLLM's KV events from now on: only a registered worker's blocks belong in the router's
        index."""
        if self.kv_plan.sources and not self.kv_publishers:
            self.kv_publishers = kv_events.start_publishers(
                self.endpoint, self.kv_plan.sources, self.capacity.block_size
            )

    async def first_of(self, *extra: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
        """Wait for a stop signal, the engine's death, or one of ``extra`` (cancelled if not done)."""
        assert self.stop_wait is not None and self.dead_wait is not None
        done, _ = await asyncio.wait(
            {self.stop_wait, self.dead_wait, *extra}, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in extra:
            if fut not in done and fut is not self.serve_task:
                fut.cancel()
        return set(done)

    async def register(self) -> None:
        """Publish the model card and the endpoint instance (the frontend then routes here)."""
        config = self.config
        self.start_kv_events()
        await registration.register(
            self.endpoint,
            config.disaggregation_mode,
            self.model_path,
            config.served_model_name,
            self.capacity,
            config.custom_jinja_template,
            kv_events=bool(self.kv_publishers),
            local_prefill=config.local_prefill,
        )

    def go_live(self) -> None:
        """Registered: keep the discovery entries alive, let FPM heartbeats out, report ready and serving."""
        assert self.readiness is not None
        self.keepalive = start_for_worker(self.config.discovery_backend, int(self.worker_id))
        if self.reaper is None:  # crashed peers leave discovery in about a second, not 10 s
            self.reaper = file_discovery_reaper.start_for_worker(
                self.config.discovery_backend, int(self.worker_id)
            )
        self.control.open_gate()
        self.readiness.set(True)
        self.control.write(ws.SERVING)

    def leave_keepalive(self) -> None:
        """Parked: stop keeping the discovery entries (the drain then removes them)."""
        if self.keepalive is not None:
            self.keepalive.stop()
            self.keepalive = None

    async def stand_by(self) -> bool:
        """With ``--standby``: loaded, not registered, until SIGUSR1 (True) or a stop (False)."""
        config = self.config
        if not config.standby:
            return True
        self.control.write(ws.STANDBY)
        log.info(
            "standby: %s loaded (%s), not registered; `kill -USR1 %d` registers it",
            config.served_model_name,
            self.worker_id,
            os.getpid(),
        )
        promote = self.loop.create_task(self.control.promoted())
        return promote in await self.first_of(promote)

    async def drain(self) -> DrainReport:
        """Unregister, let the requests in flight finish (cut at the grace period), wait for held KV."""
        return await drain(
            self.tracker,
            lambda: registration.unregister(self.endpoint),
            self.engine.abort,
            self.config.drain_timeout_s,
            self.held_kv,
            settle_s=min(DRAIN_SETTLE_S, self.config.drain_timeout_s),
        )

    async def serve_until_stopped(self) -> None:
        """Serve and register; with ``--standby`` park on SIGHUP and serve again on SIGUSR1, until a stop
        signal, the engine's death or the endpoint's end."""
        config = self.config
        assert self.handler is not None and self.readiness is not None
        t0 = time.monotonic()
        self.serve_task = asyncio.ensure_future(
            self.endpoint.serve_endpoint(
                self.handler.generate,
                graceful_shutdown=True,
                metrics_labels=[("model", config.served_model_name)],
                health_check_payload=HEALTH_CHECK_PAYLOAD,
            )
        )
        await self.register()
        self.go_live()
        self.registered = True
        log.info(
            "ready: %s (%s), %d KV blocks of %d tokens; registered in %.3f s",
            config.served_model_name,
            self.worker_id,
            self.capacity.total_kv_blocks,
            self.capacity.block_size,
            time.monotonic() - t0,
        )
        while True:
            park = self.loop.create_task(self.control.parked()) if config.standby else None
            done = await self.first_of(self.serve_task, *([park] if park is not None else []))
            if park is None or park not in done:
                return
            # Park: leave routing, finish what runs, stand by again.
            self.readiness.set(False)
            self.leave_keepalive()
            self.control.write(ws.DRAINING)
            report = await self.drain()
            self.tracker.accepting = True
            self.control.close_gate()
            kv_events.stop_publishers(self.kv_publishers)
            self.control.write(ws.STANDBY)
            log.info(
                "parked: unregistered, %d request(s) in flight: %s; standing by",
                report.inflight_at_start,
                report.summary(),
            )
            self.registered = False
            promote = self.loop.create_task(self.control.promoted())
            if promote not in await self.first_of(promote):
                return
            t0 = time.monotonic()
            await self.endpoint.register_endpoint_instance()
            await self.register()
            self.go_live()
            self.registered = True
            log.info("registered again in %.3f s", time.monotonic() - t0)

    async def finish(self) -> int:
        """After serving: drain on a stop signal (the exit code says how it went), else the engine died."""
        assert self.stop_wait is not None and self.dead_wait is not None and self.readiness is not None
        for task in (self.stop_wait, self.dead_wait):
            if not task.done():
                task.cancel()
        self.readiness.set(False)
        if self.keepalive is not None:
            self.keepalive.stop()
        if self.stop_wait.done() and not self.dead_wait.done():
            if not self.registered:
                log.info("signal received while standing by: stopping")
                return int(ExitCode.OK)
            log.info("signal received: draining (grace period %.1f s)", self.config.drain_timeout_s)
            self.control.write(ws.DRAINING)
            report = await self.drain()
            log.info(
                "drained: unregistered in %.3f s, waited %.2f s for %d request(s): %s",
                report.unregister_s,
                report.waited_s,
                report.inflight_at_start,
                report.summary(),
            )
            return int(report.exit_code)
        log.error("engine died or the endpoint stopped serving; exiting")
        if self.registered:
            with contextlib.suppress(Exception):
                await registration.unregister(self.endpoint)
        return int(ExitCode.ENGINE_DIED)

    async def close(self) -> None:
        """Clean-up on every way out: keep-alive first (never write entries back after the runtime deleted
        them), FPM relays, engine, runtime, serving task, gate, metrics, the stats folder."""
        if self.keepalive is not None:
            self.keepalive.stop()
        if self.reaper is not None:
            self.reaper.stop()
        stop_relays(self.relays)
        kv_events.stop_publishers(self.kv_publishers)
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
        with contextlib.suppress(Exception):
            self.runtime.shutdown()
        if self.serve_task is not None:
            self.serve_task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.serve_task, 5.0)
        if self.gate is not None:
            self.gate.cancel()
        if self.metrics is not None:
            self.metrics.close()
        if self.stats_dir is not None:
            shutil.rmtree(self.stats_dir, ignore_errors=True)


async def serve(config: WorkerConfig, vllm_config: Any, control: StandbyControl | None = None) -> int:
    """Run the worker until a signal or an engine death; returns the process exit code."""
    if control is None:
        control = StandbyControl(config.standby, config.state_file)
    run = WorkerRun(config, vllm_config, control, asyncio.get_running_loop())
    run.handle_signals()
    export_engine_environment(config)
    if not nats_ok(config):
        return ExitCode.STARTUP_FAILED
    run.connect_runtime()
    if not run.export_fpm_environment():
        return ExitCode.STARTUP_FAILED
    run.start_metrics()
    try:
        if not run.start_engine():
            return ExitCode.STARTUP_FAILED
        if await run.stand_by():
            await run.serve_until_stopped()
        return await run.finish()
    finally:
        await run.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``drain.ExitCode``)."""
    setup_logging()
    loopback_by_default()  # the runtime's system server, unless DYN_SYSTEM_HOST opens it
    # `kill -USR2 <pid>` prints every thread's stack to stderr: the way to see what a stuck worker waits on.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    # The Dynamo runtime starts threads; a forked EngineCore would inherit them half-copied.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:  # before vLLM loads its plugins (while parsing the engine arguments), which read it too
        shm_wait.sleep_us_from(os.environ)
    except ValueError as exc:
        fail(str(exc))
    # SIGUSR1 must never kill a worker that is still importing vLLM: handlers first, then "loading".
    try:
        control = StandbyControl(*early_options(list(sys.argv[1:] if argv is None else argv), os.environ))
    except ValueError as exc:
        fail(str(exc))
    control.install_early()
    config = parse_args(argv)
    setup_logging()  # again, now that vLLM is imported: its loggers get the runtime's format too
    try:
        transport_health_from_env(os.environ)
        file_discovery_reaper.interval_from(os.environ)
    except ValueError as exc:
        fail(str(exc))
    vllm_config = prepare(config)
    try:
        return asyncio.run(serve(config, vllm_config, control))
    except Exception as exc:
        log.exception("worker failed")
        print(f"dynamo.vllm: error: {_one_line(exc)}", file=sys.stderr)
        return ExitCode.STARTUP_FAILED
