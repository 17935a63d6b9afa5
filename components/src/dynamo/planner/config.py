"""Planner configuration: typed, defaulted, validated once at start with errors that name the bad key.

Every option lives here with its default; ``docs/planner.md`` lists them. A config is a nested mapping
(from a file, inline JSON/YAML, or CLI flags layered on top) turned into frozen dataclasses.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints
from urllib.parse import urlparse

from dynamo.common.event_plane import resolve_event_plane

Target = Literal["throughput", "latency", "load", "sla"]
ConnectorName = Literal["virtual", "local", "kubernetes"]
ScaleVia = Literal["auto", "adapter", "dgd"]
EventPlaneName = Literal["nats", "zmq"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the dotted key."""


@dataclass(frozen=True)
class Thresholds:
    """The load one engine is sized to carry: ``*_up`` at the demand's high level (mean + spread), and
    ``*_target`` on average (docs/planner.md, "Sizing").
    """

    prefill_up: float = 1.0
    decode_up: float = 1.0
    prefill_target: float = 1.0
    decode_target: float = 0.85


# The up thresholds: upstream Dynamo 1.6.1's load-based presets (dynamo/planner/core/load_scaling.py),
# same values. The *_target utilisations are ours (upstream steps one replica at a time). Upstream's down
# thresholds have no counterpart: a pool shrinks to the highest need of the stabilization window.
PRESETS: dict[str, Thresholds] = {
    "throughput": Thresholds(1.0, 1.0, 1.0, 0.85),
    "latency": Thresholds(0.1, 0.4, 0.6, 0.5),
}


@dataclass(frozen=True)
class PoolConfig:
    """Replica limits of one pool and what one replica costs in GPUs."""

    min_replicas: int = 1
    max_replicas: int = 8
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class CapacityConfig:
    """Fallback engine capacity, used only when a worker's Dynamo model card does not say."""

    context_length: int | None = None
    kv_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # KV block size in tokens, when a card states total_kv_blocks but not the block size.
    kv_block_size: int | None = None


@dataclass(frozen=True)
class SlaConfig:
    """Targets for ``target: sla`` (milliseconds) and the regression's sample window."""

    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    # Scale down only if the consolidated load is predicted within this fraction of the SLA.
    headroom: float = 0.8
    # Timing samples kept per pool for the online regressions.
    window: int = 512
    # Fewer samples than this: the model is not trusted and the policy holds.
    min_samples: int = 10


@dataclass(frozen=True)
class LocalConfig:
    """The ``local`` connector: worker processes started from command templates."""

    prefill_command: str = ""
    decode_command: str = ""
    log_dir: str = "planner-logs"
    stop_timeout_s: float = 30.0
    # A worker process stopped (SIGSTOP, a tracer) this long is killed and replaced; 0 = never.
    hung_after_s: float = 30.0
    # Processes already running at start (started by someone else) are not ours to stop.
    initial_prefill: int = 0
    initial_decode: int = 0
    # Warm standbys per pool: loaded but unregistered workers (DYN_VLLM_STANDBY=1) a scale-up promotes.
    standby_prefill: int = 0
    standby_decode: int = 0
    # Workers a previous planner started (recorded in log_dir): adopt them (true) or stop them (false).
    adopt: bool = True


@dataclass(frozen=True)
class KubernetesConfig:
    """The ``kubernetes`` connector: the DynamoGraphDeployment whose replica counts it patches."""

    # "" = DYN_PARENT_DGD_K8S_NAME, which the Dynamo operator sets in its pods.
    deployment: str = ""
    # None = POD_NAMESPACE, else the pod's service-account namespace, else "default".
    k8s_namespace: str | None = None
    prefill_service: str = "prefill"
    decode_service: str = "decode"
    api_group: str = "nvidia.com"
    api_version: str = "v1beta1"
    # Load the in-cluster service account, else the kubeconfig file (None = default location).
    kubeconfig: str | None = None
    # auto: each service through its DynamoGraphDeploymentScalingAdapter where one exists, else the DGD;
    # adapter: adapters only (a missing one is an error); dgd: patch the DGD (operators before 1.6).
    scale_via: ScaleVia = "auto"


@dataclass(frozen=True)
class VirtualConfig:
    """The ``virtual`` connector (Dynamo's VirtualConnectorCoordinator, needs the runtime's etcd)."""

    check_interval_s: int = 1
    max_wait_time_s: int = 1800


@dataclass(frozen=True)
class ForecastConfig:
    """Scaling ahead of today's demand from its trend (``policy.forecast``; docs/planner.md, "Forecast")."""

    # Off (the default): each pool is sized for its recent demand and its spread only. On the held-out traffic
    # (the Azure traces, the generated families) it cost GPU-hours and flips for no goodput (docs/planner.md).
    enabled: bool = False
    # Demand samples the trend's line is fitted to (its slope times the startup is the growth sized for).
    window_s: float = 40.0
    # A trend this consistent (r squared of its line) counts as rising.
    min_r2: float = 0.7
    # Decode: a rise under this many standard deviations of the wander of the requests in flight is noise
    # (needs the arrivals; 0 = off).
    noise_z: float = 3.0
    # Decode: while every engine is saturated, the projection is at most this many times the engines the
    # arrivals expected one startup ahead keep busy at the pool's measured completions (needs the
    # arrivals; 0 = off).
    throughput_cap: float = 1.5
    # The projected growth is at most this many times today's demand.
    projection_cap: float = 2.0


@dataclass(frozen=True)
class PlannerConfig:
    """All planner options; see docs/planner.md."""

    namespace: str = "dynamo"
    prefill_component: str = "prefill"
    decode_component: str = "backend"
    endpoint: str = "generate"
    nats_url: str | None = None
    # Seconds between decisions; at most one step per pool per interval.
    interval_s: float = 5.0
    target: Target = "throughput"
    thresholds: Thresholds | None = None
    sla: SlaConfig = field(default_factory=SlaConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    # GPUs for prefill + decode together (None = no budget); never exceeded, not even mid-rebalance.
    gpu_budget: int | None = None
    # Never below the most replicas the sizing asked for within this long (the HPA's scale-down
    # stabilization window; an idle pool's records cannot say how close to saturation it is). The fleet
    # found at the planner's first decision counts as asked for then (``rule_first_look``).
    scale_down_stabilization_s: float = 300.0
    # An action not completed by then is abandoned: the planner accepts what is running and moves on.
    action_timeout_s: float = 300.0
    # Proportional sizing: at most this many replicas added by one action (None = no cap) ...
    max_scale_up_step: int | None = None
    # ... and at most this many removed by one scale-down.
    scale_down_step: int = 1
    # Use the frontend's arrival rate when a source gives one (the simulator always does; live, see
    # ``frontend_metrics_url``): a prefill pool busy without a queue is then not consolidated.
    use_arrivals: bool = True
    # The frontends' Prometheus endpoints (``http://frontend:8000/metrics``), comma-separated: every
    # replica, as each counts only its own requests. None = no arrival source (docs/planner.md, "Arrivals").
    frontend_metrics_url: str | None = None
    # Count only this model's requests (the frontends' ``model`` label); None = every model they serve.
    frontend_model: str | None = None
    # Startup assumed until measured (seconds from a scale-up to the new replica's first record).
    expected_startup_s: float = 60.0
    # Each pool is sized for the mean of its demand over this window plus ``headroom_sigmas`` standard
    # deviations of it, at the engines' ``up`` load (docs/planner.md, "Sizing"); a prefill backlog is sized
    # to drain within it.
    demand_window_s: float = 60.0
    headroom_sigmas: float = 2.0
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    # A worker that published nothing for this long is dropped.
    stale_after_s: float = 5.0
    # Engines (worker_id, dp_rank) held per book, both pools together, and by the tracker; beyond that the
    # stalest is evicted (counted). Bounds the planner's memory against floods of forged worker ids.
    max_engines: int = 10_000
    # Observed workers != replicas: hold this long, then decide with missing workers counted against change.
    mismatch_grace_s: float = 30.0
    # A fresh (or restarted) worker's timing records feed the latency model only after this long ...
    warmup_s: float = 20.0
    # ... and after this many timing records.
    warmup_records: int = 5
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    # Read capacity from Dynamo model cards (needs the Dynamo runtime); off = configuration only.
    use_model_cards: bool = True
    # Dynamo runtime used for model cards and the virtual connector: discovery backend ("etcd" or
    # "file", which keeps its state in DYN_FILE_KV; None = env DYN_DISCOVERY_BACKEND, else etcd for
    # the virtual connector and file otherwise), request plane and event plane. The event plane also
    # carries the FPM records (None = env DYN_EVENT_PLANE, else nats if NATS_SERVER is set, else zmq:
    # dynamo.common.event_plane, the workers' rule).
    discovery_backend: str | None = None
    request_plane: str = "tcp"
    event_plane: EventPlaneName | None = None
    connector: ConnectorName = "virtual"
    dry_run: bool = False
    local: LocalConfig = field(default_factory=LocalConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    virtual: VirtualConfig = field(default_factory=VirtualConfig)
    decision_log: str | None = None
    json_stdout: bool = False
    metrics_port: int | None = None
    # Address of metrics_port (None: env DYN_SYSTEM_HOST, else 127.0.0.1; 0.0.0.0 opens it).
    metrics_host: str | None = None
    tui: bool = False

    def effective_thresholds(self) -> Thresholds:
        if self.thresholds is not None:
            return self.thresholds
        return PRESETS.get(self.target, PRESETS["throughput"])

    def resolved_metrics_host(self, env: dict[str, str]) -> str:
        return self.metrics_host or env.get("DYN_SYSTEM_HOST") or "127.0.0.1"

    def pool(self, name: str) -> PoolConfig:
        return self.prefill if name == "prefill" else self.decode

    def resolved_event_plane(self, env: dict[str, str]) -> str:
        if self.nats_url and not self.event_plane and not env.get("DYN_EVENT_PLANE"):
            return "nats"  # a NATS server was named on the command line or in the config
        return resolve_event_plane(self.event_plane, env)

    def frontend_urls(self) -> tuple[str, ...]:
        """``frontend_metrics_url`` split at commas (every frontend replica's endpoint)."""
        raw = self.frontend_metrics_url or ""
        return tuple(u.strip() for u in raw.split(",") if u.strip())

    def resolved_discovery(self, env: dict[str, str]) -> str:
        if self.discovery_backend:
            return self.discovery_backend
        if env.get("DYN_DISCOVERY_BACKEND"):
            return env["DYN_DISCOVERY_BACKEND"]
        return "etcd" if self.connector == "virtual" and not self.dry_run else "file"


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check and convert one value against a (simple) type hint."""
    args = get_args(tp)
    origin = getattr(tp, "__origin__", None)
    if is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key + ".")
    if args and type(None) in args:  # Optional
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - programming error


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown option (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _check(cfg: PlannerConfig) -> None:
    def positive(key: str, v: float | int, allow_zero: bool = False) -> None:
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {v}")

    positive("interval_s", cfg.interval_s)
    for key in ("mismatch_grace_s", "warmup_s", "scale_down_stabilization_s", "headroom_sigmas"):
        positive(key, getattr(cfg, key), allow_zero=True)
    positive("action_timeout_s", cfg.action_timeout_s)
    if cfg.max_scale_up_step is not None:
        positive("max_scale_up_step", cfg.max_scale_up_step)
    positive("scale_down_step", cfg.scale_down_step)
    positive("demand_window_s", cfg.demand_window_s)
    fc = cfg.forecast
    for key in ("window_s", "noise_z", "throughput_cap", "projection_cap"):
        positive(f"forecast.{key}", getattr(fc, key), allow_zero=True)
    if not 0.0 <= fc.min_r2 <= 1.0:
        raise ConfigError(f"forecast.min_r2: must be in [0, 1], got {fc.min_r2}")
    positive("expected_startup_s", cfg.expected_startup_s, allow_zero=True)
    positive("stale_after_s", cfg.stale_after_s)
    positive("max_engines", cfg.max_engines)
    positive("warmup_records", cfg.warmup_records, allow_zero=True)
    for url in cfg.frontend_urls():
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"frontend_metrics_url: {url!r} is not an http(s) URL with a host")
    for name in ("prefill", "decode"):
        pool = cfg.pool(name)
        positive(f"{name}.min_replicas", pool.min_replicas, allow_zero=True)
        positive(f"{name}.gpus_per_replica", pool.gpus_per_replica, allow_zero=True)
        if pool.max_replicas < pool.min_replicas:
            raise ConfigError(
                f"{name}.max_replicas: {pool.max_replicas} is below min_replicas {pool.min_replicas}"
            )
    if cfg.gpu_budget is not None:
        need = cfg.prefill.min_replicas * cfg.prefill.gpus_per_replica
        need += cfg.decode.min_replicas * cfg.decode.gpus_per_replica
        if cfg.gpu_budget < need:
            raise ConfigError(f"gpu_budget: {cfg.gpu_budget} cannot hold both pools' minimum ({need} GPUs)")
    if cfg.target == "load" and cfg.thresholds is None:
        raise ConfigError("thresholds: target 'load' needs user thresholds (prefill_up, decode_up, ...)")
    th = cfg.effective_thresholds()
    for side in ("prefill", "decode"):
        up = getattr(th, f"{side}_up")
        if not up > 0:
            raise ConfigError(f"thresholds.{side}_up: must be > 0, got {up}")
        target = getattr(th, f"{side}_target")
        if not 0 < target <= 1:
            raise ConfigError(f"thresholds.{side}_target: must be in (0, 1], got {target}")
    for key in ("ttft_ms", "itl_ms"):
        positive(f"sla.{key}", getattr(cfg.sla, key))
    if not 0 < cfg.sla.headroom <= 1:
        raise ConfigError(f"sla.headroom: must be in (0, 1], got {cfg.sla.headroom}")
    if cfg.sla.window < 3:
        raise ConfigError(f"sla.window: must be >= 3, got {cfg.sla.window}")
    for key in ("context_length", "kv_tokens", "max_num_batched_tokens", "max_num_seqs", "kv_block_size"):
        v = getattr(cfg.capacity, key)
        if v is not None:
            positive(f"capacity.{key}", v)
    if cfg.connector == "local" and not cfg.dry_run:
        for name in ("prefill", "decode"):
            if not getattr(cfg.local, f"{name}_command"):
                raise ConfigError(f"local.{name}_command: a worker command template is required")
    for key in ("initial_prefill", "initial_decode", "standby_prefill", "standby_decode"):
        positive(f"local.{key}", getattr(cfg.local, key), allow_zero=True)
    positive("local.stop_timeout_s", cfg.local.stop_timeout_s)
    positive("local.hung_after_s", cfg.local.hung_after_s, allow_zero=True)
    for name in ("prefill", "decode"):
        standby = getattr(cfg.local, f"standby_{name}")
        if standby and cfg.pool(name).max_replicas == 0:
            raise ConfigError(
                f"local.standby_{name}: the {name} pool has max_replicas 0, a standby would never serve"
            )
    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port < 65536:
        raise ConfigError(f"metrics_port: {cfg.metrics_port} is not a port")


def config_from_mapping(data: dict[str, Any]) -> PlannerConfig:
    """Build and validate a config; raises :class:`ConfigError` naming the bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
    cfg = _build(PlannerConfig, data)
    _check(cfg)
    return cfg


def load_config_text(text: str) -> dict[str, Any]:
    """Parse inline JSON or YAML (YAML is a superset of JSON) into a mapping."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config: not valid JSON or YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
    return data


def load_config_arg(arg: str | None) -> dict[str, Any]:
    """``--config`` value: a file path, or inline JSON/YAML text."""
    if not arg:
        return {}
    path = Path(arg)
    if not arg.lstrip().startswith(("{", "[")) and "\n" not in arg and path.is_file():
        return load_config_text(path.read_text())
    if not arg.lstrip().startswith("{") and ":" not in arg:
        raise ConfigError(f"config: {arg!r} is neither a readable file nor inline JSON/YAML")
    return load_config_text(arg)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base`` (CLI flags over the config file)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def with_overrides(cfg: PlannerConfig, **kwargs: Any) -> PlannerConfig:
    return replace(cfg, **kwargs)
