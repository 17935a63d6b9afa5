"""The vLLM side of the worker: scheduler choice, the FPM environment of the engine process, engine start.

``choose_scheduler`` and ``fpm_environment`` are pure so the wiring is testable without an engine.
The scheduler reads its settings from the environment because it runs in vLLM's EngineCore process,
which inherits the worker's environment when it is spawned.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from dynamo.vllm.args import INSTRUMENTED_SCHEDULER, WorkerConfig
from dynamo.vllm.cpu_host.env_defaults import cpu_environment
from dynamo.vllm.fpm_env import ENV_NATS, FpmSettings, stats_file_in

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerChoice:
    """Which scheduler class the engine gets, whether FPM is on, and the one warning to log if not."""

    scheduler_cls: str | None
    fpm_enabled: bool
    warning: str | None = None


def instrumented_scheduler_available() -> bool:
    """True when the InstrumentedScheduler module is installed (EngineCore must be able to import it)."""
    module = INSTRUMENTED_SCHEDULER.rsplit(".", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def choose_scheduler(user_scheduler: str | None, fpm_requested: bool, available: bool) -> SchedulerChoice:
    """Inject the InstrumentedScheduler unless the user chose another one or FPM is off or missing."""
    if user_scheduler and user_scheduler != INSTRUMENTED_SCHEDULER:
        return SchedulerChoice(
            user_scheduler,
            False,
            f"--scheduler-cls {user_scheduler} replaces {INSTRUMENTED_SCHEDULER}: "
            "forward-pass metrics (FPM) are OFF for this worker",
        )
    if not fpm_requested:
        return SchedulerChoice(user_scheduler, False, None)
    if not available:
        return SchedulerChoice(
            user_scheduler,
            False,
            f"{INSTRUMENTED_SCHEDULER} is not importable: forward-pass metrics (FPM) are OFF for this worker",
        )
    return SchedulerChoice(INSTRUMENTED_SCHEDULER, True, None)


def fpm_environment(
    config: WorkerConfig,
    worker_id: str,
    fpm_enabled: bool,
    stats_dir: str,
    zmq_port: int | None = None,
    gate_file: str | None = None,
) -> dict[str, str]:
    """Environment the InstrumentedScheduler reads in the EngineCore process (one stream per dp rank).

    ``zmq_port`` set: the engine publishes for the worker's FpmEventRelay on the ZMQ event plane
    (``DYN_FORWARDPASS_METRIC_PORT``); the caller removes that variable from the engine's environment
    otherwise, so that the engine publishes on NATS.
    """
    return FpmSettings(
        enabled=fpm_enabled,
        namespace=config.namespace,
        component=config.component,
        endpoint=config.endpoint,
        worker_id=worker_id,
        nats_url=os.environ.get(ENV_NATS) or None,
        stats_file=stats_file_in(stats_dir),
        gate_file=gate_file,
        zmq_port=zmq_port,
    ).worker_env()


def make_stats_dir() -> str:
    """A private folder for the publisher's per-rank counter files (removed by the worker on exit)."""
    return tempfile.mkdtemp(prefix="dynamo-vllm-fpm-")


def disaggregation_environment(
    mode: str, environ: dict[str, str], free_port: int, *, cpu_platform: bool = False
) -> dict[str, str]:
    """Defaults for a prefill or decode worker; a variable the user already set is never changed.

    - NIXL side channel on one machine: loopback host and a free port.
    - On vLLM's CPU platform, the CPU-host defaults of
      :func:`dynamo.vllm.cpu_host.env_defaults.cpu_environment` (OpenMP threads unbound, engine waits that
      sleep; why: docs/workarounds.md).
    """
    if mode not in ("prefill", "decode"):
        return {}
    env: dict[str, str] = {}
    if not environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST"):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    if not environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT"):
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port)
    if cpu_platform:
        env.update(cpu_environment(environ))
    return env


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here (vLLM is imported by the time this is asked)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def create_vllm_config(engine_args: Any) -> Any:
    """vLLM's full config (validates every engine argument and reads the model config; no engine yet)."""
    from vllm.usage.usage_lib import UsageContext

    return engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def start_engine(vllm_config: Any, engine_args: Any) -> Any:
    """Start the AsyncLLM (EngineCore in a child process) for an already validated config."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_vllm_config(
        vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=getattr(engine_args, "enable_log_requests", False),
        disable_log_stats=getattr(engine_args, "disable_log_stats", False),
    )


@dataclass(frozen=True)
class EngineCapacity:
    """What a planner needs to judge this engine's capacity; read from vLLM's config after start."""

    context_length: int
    total_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    data_parallel_size: int
    data_parallel_start_rank: int


def summed_engines(parallel_config: Any, engine_client: Any = None) -> int:
    """How many engines' KV blocks vLLM added up in ``cache_config.num_gpu_blocks``.

    vLLM's engine client adds the block count each engine reports at start-up: with data parallelism the
    figure is the sum over every engine the client manages (all ranks with internal load balancing, the local
    ones with hybrid or external balancing, one in offline mode). The client's own list is used when it has
    one.
    """
    ranks = getattr(getattr(engine_client, "engine_core", None), "engine_ranks_managed", None)
    if isinstance(ranks, list | tuple) and ranks:
        return len(ranks)
    if getattr(parallel_config, "data_parallel_rank_local", None) is not None:
        return 1
    size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    if getattr(parallel_config, "local_engines_only", False):
        size = int(getattr(parallel_config, "data_parallel_size_local", size) or size)
    return max(1, size)


def engine_capacity(vllm_config: Any, engines: int = 1) -> EngineCapacity:
    """Per-engine figures: vLLM's ``num_gpu_blocks`` is the sum over the ``engines`` it started
    (:func:`summed_engines`); registering the sum as one engine's capacity overstated each engine's KV cache
    by the data-parallel size. Unequal counts are floored (a planner must not count blocks an engine
    lacks)."""
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    par = vllm_config.parallel_config
    total = int(cache.num_gpu_blocks or 0)
    engines = max(1, engines)
    if total % engines:
        log.warning(
            "vLLM's %d KV blocks do not divide evenly over %d engines: registering %d per engine",
            total,
            engines,
            total // engines,
        )
    return EngineCapacity(
        context_length=int(vllm_config.model_config.max_model_len),
        total_kv_blocks=total // engines,
        block_size=int(cache.block_size),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        data_parallel_size=int(getattr(par, "data_parallel_size", 1) or 1),
        data_parallel_start_rank=int(getattr(par, "data_parallel_rank", 0) or 0),
    )
