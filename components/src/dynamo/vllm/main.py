"""``python -m dynamo.vllm``: a vLLM engine served behind Dynamo's frontend, publishing FPM.

Startup: parse and validate (exit 2 on bad arguments, before anything starts), choose the scheduler,
let vLLM validate its whole config, create the Dynamo runtime and the generate endpoint, export the
FPM environment (worker id = the endpoint's connection id), start the engine, serve, register, report
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
from typing import Any
from urllib.parse import urlparse

from dynamo.common import worker_state as ws
from dynamo.common.cli_setup import loopback_by_default, setup_logging
from dynamo.common.ports import stable_free_port
from dynamo.vllm import engine as eng
from dynamo.vllm import engine_hooks, registration
from dynamo.vllm.args import WorkerConfig, fail, parse_args
from dynamo.vllm.cpu_host import env_defaults, shm_wait
from dynamo.vllm.drain import ExitCode, InflightTracker, drain, held_kv_reader
from dynamo.vllm.fpm_env import ENV_GATE_FILE
from dynamo.vllm.fpm_metrics import WorkerCollector, WorkerMetrics
from dynamo.vllm.handlers import RequestHandler
from dynamo.vllm.health import (
    HEALTH_CHECK_PAYLOAD,
    Readiness,
    gate_on_transport,
    transport_health_from_env,
    wait_engine_dead,
)
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


async def serve(config: WorkerConfig, vllm_config: Any, control: StandbyControl | None = None) -> int:
    """Run the worker until a signal or an engine death; returns the process exit code."""
    from dynamo.runtime import DistributedRuntime

    transport_mode, transport_grace = transport_health_from_env(os.environ)  # checked by main()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if control is None:
        control = StandbyControl(config.standby, config.state_file)
    control.standby, control.state_file = config.standby, config.state_file
    control.attach(loop)

    disagg_env = eng.disaggregation_environment(
        config.disaggregation_mode, dict(os.environ), stable_free_port(), cpu_platform=eng.is_cpu_platform()
    )
    for name, why in env_defaults.REASONS.items():
        if name in disagg_env:
            log.info("%s=%s: %s", name, disagg_env[name], why)
    os.environ.update(disagg_env)
    nats = os.environ.get("NATS_SERVER", "")
    needs_nats = config.event_plane == "nats" or config.request_plane == "nats"
    if needs_nats and not nats_reachable(nats or "nats://localhost:4222"):
        log.error("NATS_SERVER %r is not reachable (needed by the nats event/request plane)", nats)
        print(f"dynamo.vllm: error: NATS_SERVER {nats!r} is not reachable", file=sys.stderr)
        return ExitCode.STARTUP_FAILED
    runtime = DistributedRuntime(
        loop, config.discovery_backend, config.request_plane, event_plane=config.event_plane
    )
    readiness = Readiness(runtime)
    readiness.set(False)
    endpoint = runtime.endpoint(config.endpoint_path)
    worker_id = str(endpoint.connection_id())
    control.worker_id = worker_id
    stats_dir = eng.make_stats_dir()
    fpm_env = eng.fpm_environment(config, worker_id, config.fpm_enabled, stats_dir)
    if config.standby:  # no FPM heartbeats until registered: a standby is no pool member
        control.gate_file = gate_path(stats_dir)
        fpm_env[ENV_GATE_FILE] = str(control.gate_file)
    os.environ.update(fpm_env)
    # For the engine processes' hooks (engine_hooks): they end with this process, and act only below it.
    os.environ[engine_hooks.WORKER_PID_ENV] = str(os.getpid())
    log.info(
        "worker %s serving %s (%s mode), FPM %s",
        worker_id,
        config.endpoint_path,
        config.disaggregation_mode,
        "on" if config.fpm_enabled else "off",
    )

    tracker = InflightTracker()
    # A prefill engine holds each prompt's KV blocks until a decode worker has read them: the drain waits for
    # that.
    held_kv = None
    if config.disaggregation_mode == "prefill":
        if config.fpm_enabled:
            held_kv = held_kv_reader(fpm_env["DYN_FPM_STATS_FILE"])
        else:
            log.warning(
                "FPM is off: a drain cannot see the KV blocks held for decode workers and will not wait"
            )
    collector = WorkerCollector(
        fpm_env["DYN_FPM_STATS_FILE"] if config.fpm_enabled else None,
        lambda: tracker.count,
        readiness,
        {
            "dynamo_namespace": config.namespace,
            "dynamo_component": config.component,
            "dynamo_endpoint": config.endpoint,
            "worker_id": worker_id,
        },
    )
    metrics = WorkerMetrics(collector)
    with contextlib.suppress(Exception):
        endpoint.metrics.register_prometheus_expfmt_callback(metrics.expfmt)
    if config.metrics_port is not None:
        port = metrics.serve(config.metrics_port, host=config.metrics_host)
        log.info("Prometheus metrics on port %d (%s)", port, config.metrics_host)
    gate: asyncio.Task[None] | None = None
    if transport_mode == "gate" and config.fpm_enabled:
        gate = loop.create_task(gate_on_transport(readiness, collector.health, grace_s=transport_grace))

    engine = None
    keepalive: FileDiscoveryKeepAlive | None = None
    serve_task: asyncio.Future[Any] | None = None
    code: int = ExitCode.OK
    try:
        try:
            engine = eng.start_engine(vllm_config, config.engine_args)
        except Exception as exc:
            log.error("engine failed to start: %s", _one_line(exc))
            print(f"dynamo.vllm: error: engine failed to start: {_one_line(exc)}", file=sys.stderr)
            return ExitCode.STARTUP_FAILED
        capacity = eng.engine_capacity(
            engine.vllm_config, eng.summed_engines(engine.vllm_config.parallel_config, engine)
        )
        model_config = engine.vllm_config.model_config
        handler = RequestHandler(
            engine,
            config.disaggregation_mode,
            tracker,
            capacity.context_length,
            model_config.get_diff_sampling_param(),
            capacity.data_parallel_start_rank,
            capacity.data_parallel_size,
        )
        model_path = (
            config.model
            if not os.path.isdir(os.path.expanduser(config.model))
            else os.path.abspath(os.path.expanduser(config.model))
        )

        async def register() -> None:
            await registration.register(
                endpoint,
                config.disaggregation_mode,
                model_path,
                config.served_model_name,
                capacity,
                config.custom_jinja_template,
            )

        def go_live() -> FileDiscoveryKeepAlive | None:
            alive = start_for_worker(config.discovery_backend, int(worker_id))
            control.open_gate()
            readiness.set(True)
            control.write(ws.SERVING)
            return alive

        stop_wait = loop.create_task(stop.wait())
        dead_wait = loop.create_task(wait_engine_dead(engine))

        async def first_of(*extra: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
            """Wait for a stop signal, the engine's death, or one of ``extra`` (cancelled if not done)."""
            done, _ = await asyncio.wait({stop_wait, dead_wait, *extra}, return_when=asyncio.FIRST_COMPLETED)
            for fut in extra:
                if fut not in done and fut is not serve_task:
                    fut.cancel()
            return set(done)

        registered = True
        if config.standby:
            control.write(ws.STANDBY)
            log.info(
                "standby: %s loaded (%s), not registered; `kill -USR1 %d` registers it",
                config.served_model_name,
                worker_id,
                os.getpid(),
            )
            promote = loop.create_task(control.promoted())
            registered = promote in await first_of(promote)
        if registered:
            t0 = time.monotonic()
            serve_task = asyncio.ensure_future(
                endpoint.serve_endpoint(
                    handler.generate,
                    graceful_shutdown=True,
                    metrics_labels=[("model", config.served_model_name)],
                    health_check_payload=HEALTH_CHECK_PAYLOAD,
                )
            )
            await register()
            keepalive = go_live()
            log.info(
                "ready: %s (%s), %d KV blocks of %d tokens; registered in %.3f s",
                config.served_model_name,
                worker_id,
                capacity.total_kv_blocks,
                capacity.block_size,
                time.monotonic() - t0,
            )
            while True:
                park = loop.create_task(control.parked()) if config.standby else None
                done = await first_of(serve_task, *([park] if park is not None else []))
                if park is None or park not in done:
                    break
                # Park: leave routing, finish what runs, stand by again.
                readiness.set(False)
                if keepalive is not None:
                    keepalive.stop()
                    keepalive = None
                control.write(ws.DRAINING)
                report = await drain(
                    tracker,
                    lambda: registration.unregister(endpoint),
                    engine.abort,
                    config.drain_timeout_s,
                    held_kv,
                )
                tracker.accepting = True
                control.close_gate()
                control.write(ws.STANDBY)
                log.info(
                    "parked: unregistered, %d request(s) in flight: %s; standing by",
                    report.inflight_at_start,
                    report.summary(),
                )
                registered = False
                promote = loop.create_task(control.promoted())
                if promote not in await first_of(promote):
                    break
                t0 = time.monotonic()
                await endpoint.register_endpoint_instance()
                await register()
                keepalive = go_live()
                registered = True
                log.info("registered again in %.3f s", time.monotonic() - t0)

        for task in (stop_wait, dead_wait):
            if not task.done():
                task.cancel()
        readiness.set(False)
        if keepalive is not None:
            keepalive.stop()
        if stop_wait.done() and not dead_wait.done():
            if registered:
                log.info("signal received: draining (grace period %.1f s)", config.drain_timeout_s)
                control.write(ws.DRAINING)
                report = await drain(
                    tracker,
                    lambda: registration.unregister(endpoint),
                    engine.abort,
                    config.drain_timeout_s,
                    held_kv,
                )
                log.info(
                    "drained: unregistered in %.3f s, waited %.2f s for %d request(s): %s",
                    report.unregister_s,
                    report.waited_s,
                    report.inflight_at_start,
                    report.summary(),
                )
                code = report.exit_code
            else:
                log.info("signal received while standing by: stopping")
        else:
            log.error("engine died or the endpoint stopped serving; exiting")
            if registered:
                with contextlib.suppress(Exception):
                    await registration.unregister(endpoint)
            code = ExitCode.ENGINE_DIED
    finally:
        if keepalive is not None:  # before the runtime deletes our entries: never write them back
            keepalive.stop()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()
        with contextlib.suppress(Exception):
            runtime.shutdown()
        if serve_task is not None:
            serve_task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(serve_task, 5.0)
        if gate is not None:
            gate.cancel()
        metrics.close()
        shutil.rmtree(stats_dir, ignore_errors=True)
    return int(code)


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
    except ValueError as exc:
        fail(str(exc))
    vllm_config = prepare(config)
    try:
        return asyncio.run(serve(config, vllm_config, control))
    except Exception as exc:
        log.exception("worker failed")
        print(f"dynamo.vllm: error: {_one_line(exc)}", file=sys.stderr)
        return ExitCode.STARTUP_FAILED
