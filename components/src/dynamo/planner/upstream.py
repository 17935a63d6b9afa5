"""Upstream Dynamo 1.6.1 planner configs, read as ours: each upstream key mapped, ignored or refused.

Upstream's planner takes one ``--config`` (JSON/YAML) with flat keys (``optimization_target``,
``min_endpoint``, ``max_gpu_budget``, ...). :func:`translate` turns the upstream keys of a mapping into
our keys and leaves ours untouched, so an upstream config runs unchanged. Every upstream key is one of:

- **mapped**: it sets one or more of our keys (``optimization_target`` -> ``target``);
- **ignored**: accepted, with no effect on scaling decisions here (diagnostics, dashboards, inputs of
  upstream's predictive throughput scaling when that is off) -- reported, never silent;
- **refused**: a value whose behaviour we do not have (``enable_throughput_scaling: true``,
  ``mode: prefill``, ...): a :class:`ConfigError` naming the key, so nothing runs on a wrong reading.

The table (:data:`RULES`) is the one source for the translation, ``config --mapping`` and the docs
(docs/from-upstream.md). Values and defaults are upstream 1.6.1's (``dynamo/planner/config``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError
from .connector_kubernetes import DGD_NAME_ENV, NAMESPACE_ENV

# Upstream 1.6.1's defaults applied to an upstream config that leaves them out (SLAPlannerDefaults):
# the GPU budget (negative disables it) and the environment (our connector).
UPSTREAM_MAX_GPU_BUDGET = 8
UPSTREAM_ENVIRONMENT = "kubernetes"
# The operator injects the parent DynamoGraphDeployment's name and the pod's namespace.

Sets = list[tuple[str, Any]]
Handler = Callable[[Any, Mapping[str, Any]], Sets]


@dataclass(frozen=True)
class Rule:
    """How one upstream key is read: ``ours`` names the keys it sets (docs), ``handle`` does it."""

    ours: str
    note: str
    handle: Handler


@dataclass(frozen=True)
class Entry:
    """One upstream key of a translated config and what became of it."""

    key: str
    value: Any
    sets: tuple[tuple[str, Any], ...]
    note: str

    def line(self) -> str:
        if not self.sets:
            return f"upstream {self.key}: {self.value!r} -> nothing to set ({self.note})"
        ours = ", ".join(f"{k}: {v!r}" for k, v in self.sets)
        return f"upstream {self.key}: {self.value!r} -> {ours}"


@dataclass
class Translation:
    """Our config mapping plus what each upstream key became (empty for a config of ours)."""

    data: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)

    def explain(self, exc: ConfigError) -> ConfigError:
        """``exc`` naming the upstream key too when it is about a key that one set."""
        key = str(exc).split(":", 1)[0]
        for e in self.entries:
            if any(ours == key for ours, _ in e.sets):
                return ConfigError(f"{exc} (set from upstream {e.key}: {e.value!r})")
        if key == "kubernetes.deployment" and any(
            ours == "connector" for e in self.entries for ours, _ in e.sets
        ):
            return ConfigError(f"{exc}; the connector is kubernetes, upstream's default environment")
        return exc


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(f"{key}: {why} (upstream 1.6.1 key; see docs/from-upstream.md)")


def _to(ours: str, convert: Callable[[Any], Any] = lambda v: v) -> Handler:
    return lambda v, _data: [(ours, convert(v))]


def _ignored(v: Any, _data: Mapping[str, Any]) -> Sets:
    return []


def _allow(key: str, allowed: Callable[[Any], bool], why: str) -> Handler:
    """Ignored while ``allowed(value)`` (e.g. a feature left off), refused otherwise."""

    def handle(v: Any, _data: Mapping[str, Any]) -> Sets:
        if not allowed(v):
            raise _refuse(key, why)
        return []

    return handle


def _number(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _integer(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key}: expected an integer, got {v!r}")
    return v


def _environment(v: Any, _data: Mapping[str, Any]) -> Sets:
    if v == "kubernetes":
        return [("connector", "kubernetes")]
    if v == "virtual":
        return [("connector", "virtual")]
    raise _refuse("environment", f"{v!r} is not supported (kubernetes, virtual)")


def _backend(v: Any, _data: Mapping[str, Any]) -> Sets:
    if v not in ("vllm", "mocker"):
        raise _refuse("backend", f"{v!r} is not supported: this planner scales vLLM (or mocker) workers")
    return []


def _mode(v: Any, _data: Mapping[str, Any]) -> Sets:
    if v == "disagg":
        return []
    if v == "agg":
        return [("prefill.min_replicas", 0), ("prefill.max_replicas", 0)]
    raise _refuse(
        "mode",
        f"{v!r} is not supported: the planner scales both pools (disagg) or the decode pool alone (agg)",
    )


def _min_endpoint(v: Any, data: Mapping[str, Any]) -> Sets:
    n = _integer("min_endpoint", v)
    out: Sets = []
    if data.get("mode") != "agg" and data.get("prefill_min_endpoint") is None:
        out.append(("prefill.min_replicas", n))
    if data.get("decode_min_endpoint") is None:
        out.append(("decode.min_replicas", n))
    return out


def _pool_min(pool: str) -> Handler:
    def handle(v: Any, _data: Mapping[str, Any]) -> Sets:
        return [] if v is None else [(f"{pool}.min_replicas", _integer(f"{pool}_min_endpoint", v))]

    return handle


def _gpus(pool: str) -> Handler:
    def handle(v: Any, _data: Mapping[str, Any]) -> Sets:
        return [] if v is None else [(f"{pool}.gpus_per_replica", _integer(f"{pool}_engine_num_gpu", v))]

    return handle


def _max_gpu_budget(v: Any, _data: Mapping[str, Any]) -> Sets:
    n = _integer("max_gpu_budget", v)
    return [("gpu_budget", None if n < 0 else n)]


def _interval(key: str) -> Handler:
    return lambda v, _data: [("interval_s", _number(key, v))]


def _percent(key: str, *ours: str) -> Handler:
    def handle(v: Any, _data: Mapping[str, Any]) -> Sets:
        if v is None:
            return []
        pct = _number(key, v)
        if not 0 <= pct <= 100:
            raise ConfigError(f"{key}: must be in 0..100, got {v!r}")
        return [(k, pct / 100.0) for k in ours]

    return handle


def _sensitivity(v: Any, data: Mapping[str, Any]) -> Sets:
    pct = _number("load_scaling_down_sensitivity", v)
    if not 0 < pct <= 100:
        raise _refuse(
            "load_scaling_down_sensitivity", f"must be in 1..100 here (0 never scales down), got {v!r}"
        )
    return [("sla.headroom", pct / 100.0)]


def _prefill_queue_tokens(key: str) -> Handler:
    def handle(v: Any, data: Mapping[str, Any]) -> Sets:
        if v is None or data.get("mode") == "agg":
            return []
        raise _refuse(
            key,
            "absolute prefill queue-token thresholds are not supported: our prefill load is queued "
            "tokens / the engine's context length; set thresholds.prefill_up instead",
        )

    return handle


def _scaling_modes(upstream: Mapping[str, Any]) -> None:
    """Upstream's two scaling modes: only load-based scaling is ours. With ``optimization_target: sla``
    upstream runs throughput scaling unless told otherwise (and load scaling only when told); other
    targets force load scaling on and throughput scaling off, which is what we do."""
    if upstream.get("optimization_target", "throughput") != "sla":
        return
    throughput = upstream.get("enable_throughput_scaling", True)
    if throughput is not False:
        default = (
            ""
            if "enable_throughput_scaling" in upstream
            else " (on by default with optimization_target: sla)"
        )
        raise _refuse(
            "enable_throughput_scaling",
            f"upstream's predictive throughput scaling (traffic prediction + profiled performance model)"
            f"{default} is not supported; set enable_throughput_scaling: false and enable_load_scaling: true "
            "(our sla target is upstream's load-based SLA scaling)",
        )
    if upstream.get("enable_load_scaling", False) is not True:
        raise _refuse("enable_load_scaling", "optimization_target: sla needs enable_load_scaling: true here")


def _metrics_port(key: str) -> Handler:
    def handle(v: Any, _data: Mapping[str, Any]) -> Sets:
        port = _integer(key, v)
        return [("metrics_port", None if port == 0 else port)]

    return handle


def _scheduling(v: Any, _data: Mapping[str, Any]) -> Sets:
    if isinstance(v, Mapping):
        if v.get("external_plugins"):
            raise _refuse("scheduling.external_plugins", "planner plugins are not supported")
        if isinstance(v.get("gateway"), Mapping) and v["gateway"].get("enabled"):
            raise _refuse("scheduling.gateway.enabled", "the plugin registry gateway is not supported")
    return []


NO_EFFECT_THROUGHPUT = "input of upstream's predictive throughput scaling, which is off here"
NO_EFFECT_REPORT = "upstream's diagnostics reports and dashboard; ours: decision_log, --tui, metrics"


def _unset(v: Any) -> bool:
    return v is None


RULES: dict[str, Rule] = {
    "optimization_target": Rule("target", "same values", _to("target")),
    "environment": Rule(
        "connector",
        "kubernetes -> kubernetes, virtual -> virtual; global-planner refused; unset in an upstream config: "
        f"{UPSTREAM_ENVIRONMENT}",
        _environment,
    ),
    "backend": Rule("-", "vllm and mocker accepted (nothing to set); others refused", _backend),
    "mode": Rule(
        "prefill.min/max_replicas",
        "disagg: both pools; agg: prefill pool fixed at 0; prefill/decode refused",
        _mode,
    ),
    "min_endpoint": Rule("prefill.min_replicas, decode.min_replicas", "unless role-specific", _min_endpoint),
    "prefill_min_endpoint": Rule("prefill.min_replicas", "", _pool_min("prefill")),
    "decode_min_endpoint": Rule("decode.min_replicas", "", _pool_min("decode")),
    "max_gpu_budget": Rule(
        "gpu_budget",
        f"negative: no budget; unset in an upstream config: {UPSTREAM_MAX_GPU_BUDGET}",
        _max_gpu_budget,
    ),
    "min_gpu_budget": Rule(
        "-",
        "-1 (off) accepted; a GPU floor is refused",
        _allow("min_gpu_budget", lambda v: v == -1, "a GPU floor is not supported (only -1, off)"),
    ),
    "prefill_engine_num_gpu": Rule("prefill.gpus_per_replica", "", _gpus("prefill")),
    "decode_engine_num_gpu": Rule("decode.gpus_per_replica", "", _gpus("decode")),
    "ttft_ms": Rule("sla.ttft_ms", "", _to("sla.ttft_ms")),
    "ttft": Rule("sla.ttft_ms", "upstream alias of ttft_ms", _to("sla.ttft_ms")),
    "itl_ms": Rule("sla.itl_ms", "", _to("sla.itl_ms")),
    "itl": Rule("sla.itl_ms", "upstream alias of itl_ms", _to("sla.itl_ms")),
    "load_adjustment_interval_seconds": Rule("interval_s", "", _interval("load_adjustment_interval_seconds")),
    "load_adjustment_interval": Rule("interval_s", "upstream alias", _interval("load_adjustment_interval")),
    "adjustment_interval": Rule(
        "interval_s", "pre-1.0 upstream name (--adjustment-interval)", _interval("adjustment_interval")
    ),
    "max_num_fpm_samples": Rule("sla.window", "FPM samples kept for the regressions", _to("sla.window")),
    "load_min_observations": Rule(
        "sla.min_samples", "samples before the regression is trusted", _to("sla.min_samples")
    ),
    "load_scaling_down_sensitivity": Rule(
        "sla.headroom",
        "percent -> fraction (target sla; the load targets shrink to the stabilization's highest need)",
        _sensitivity,
    ),
    "decode_scale_up_kv_rate": Rule(
        "thresholds.decode_up",
        "percent -> fraction: the load the decode demand's level is sized for",
        _percent("decode_scale_up_kv_rate", "thresholds.decode_up"),
    ),
    "decode_scale_down_kv_rate": Rule(
        "-",
        "checked (0..100), nothing to set: a pool shrinks to the stabilization window's highest need",
        _percent("decode_scale_down_kv_rate"),
    ),
    "prefill_scale_up_queue_tokens": Rule(
        "-",
        "refused (agg: ignored): set thresholds.prefill_up",
        _prefill_queue_tokens("prefill_scale_up_queue_tokens"),
    ),
    "prefill_scale_down_queue_tokens": Rule(
        "-", "nothing to set: a pool shrinks to the stabilization window's highest need", _ignored
    ),
    "enable_load_scaling": Rule(
        "-", "load-based scaling is what we do; with optimization_target sla it must be true", _ignored
    ),
    "enable_throughput_scaling": Rule(
        "-", "with optimization_target sla it must be false (no predictive throughput scaling)", _ignored
    ),
    "advisory": Rule("dry_run", "", _to("dry_run")),
    "no_operation": Rule("dry_run", "pre-1.0 upstream name (--no-operation)", _to("dry_run")),
    "metric_reporting_prometheus_port": Rule(
        "metrics_port", "0: off", _metrics_port("metric_reporting_prometheus_port")
    ),
    "prometheus_port": Rule(
        "metrics_port", "pre-1.0 upstream name; 0: off", _metrics_port("prometheus_port")
    ),
    "speculative_nextn": Rule(
        "-",
        "0 accepted; speculative-decoding discounts refused",
        _allow(
            "speculative_nextn",
            lambda v: v in (0, None),
            "speculative-decoding discounts are not supported (only 0)",
        ),
    ),
    "enable_power_awareness": Rule(
        "-",
        "false accepted",
        _allow("enable_power_awareness", lambda v: v is False, "power-aware scaling is not supported"),
    ),
    "total_gpu_power_limit": Rule(
        "-", "unset accepted", _allow("total_gpu_power_limit", _unset, "power-aware scaling is not supported")
    ),
    "aic_interpolation": Rule(
        "-",
        "unset accepted",
        _allow("aic_interpolation", _unset, "AI Configurator performance seeding is not supported"),
    ),
    "ais_perf_model": Rule(
        "-",
        "unset accepted",
        _allow("ais_perf_model", _unset, "AISimulate performance models are not supported"),
    ),
    "global_planner_namespace": Rule(
        "-",
        "unset accepted",
        _allow("global_planner_namespace", _unset, "the global planner is not supported"),
    ),
    "control_api_port": Rule(
        "-",
        "0 (off) accepted",
        _allow("control_api_port", lambda v: v == 0, "the control API is not supported (only 0, off)"),
    ),
    "scheduling": Rule("-", "accepted without plugins", _scheduling),
    "plugin_registration": Rule("-", "no plugin pipeline here", _ignored),
    "pre_deployment_sweeping_mode": Rule(
        "-", "the profiler's setting; live samples seed our regressions", _ignored
    ),
    "profile_results_dir": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "throughput_adjustment_interval_seconds": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "throughput_adjustment_interval": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "max_throughput_scaling_replicas": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "throughput_metrics_source": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "load_predictor": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "load_predictor_log1p": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "load_predictor_warmup_trace": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "prophet_window_size": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "kalman_q_level": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "kalman_q_trend": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "kalman_r": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "kalman_min_points": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "isl": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "osl": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_endpoint": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_token": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_token_file": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_ssl_verify": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_extra_query_params": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_ca_bundle": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "metric_pulling_prometheus_request_timeout_seconds": Rule("-", NO_EFFECT_THROUGHPUT, _ignored),
    "model_name": Rule("-", "workers are found by namespace/component, not model name", _ignored),
    "fpm_sample_bucket_size": Rule(
        "-", "our regressions keep a sliding window (sla.window), no buckets", _ignored
    ),
    "log_dir": Rule("-", NO_EFFECT_REPORT, _ignored),
    "report_interval_hours": Rule("-", NO_EFFECT_REPORT, _ignored),
    "report_output_dir": Rule("-", NO_EFFECT_REPORT, _ignored),
    "report_filename": Rule("-", NO_EFFECT_REPORT, _ignored),
    "report_write_gzip_log": Rule("-", NO_EFFECT_REPORT, _ignored),
    "live_dashboard_port": Rule("-", NO_EFFECT_REPORT, _ignored),
}

# Upstream keys whose ``--dashed-name VALUE`` flags ``run``/``config``/``replay`` accept (pre-1.0
# upstream planners took flags; 1.6.1 only ``--config``). Values are parsed as YAML scalars.
FLAG_KEYS = (
    "environment",
    "backend",
    "mode",
    "optimization_target",
    "min_endpoint",
    "prefill_min_endpoint",
    "decode_min_endpoint",
    "max_gpu_budget",
    "prefill_engine_num_gpu",
    "decode_engine_num_gpu",
    "load_adjustment_interval_seconds",
    "adjustment_interval",
    "ttft_ms",
    "itl_ms",
    "ttft",
    "itl",
    "load_scaling_down_sensitivity",
    "load_min_observations",
    "metric_reporting_prometheus_port",
)


def _set(out: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set ``a.b`` in ``out``; a different value already there (from our own keys) is a conflict."""
    *parents, leaf = dotted.split(".")
    node = out
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: sets {dotted}, but {p} is not a mapping")
        node = child
    if leaf in node and node[leaf] != value:
        raise ConfigError(f"{source}: sets {dotted} to {value!r}, but the config sets it to {node[leaf]!r}")
    node[leaf] = value


def translate(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Translation:
    """Our config mapping from one that may hold upstream keys; raises :class:`ConfigError` for a
    key we cannot honour. A mapping without upstream keys comes back unchanged."""
    upstream = {k: v for k, v in data.items() if k in RULES}
    out = {k: v for k, v in data.items() if k not in RULES}
    if not upstream:
        return Translation(dict(data))
    _scaling_modes(upstream)
    entries: list[Entry] = []
    for key, value in upstream.items():
        rule = RULES[key]
        sets = rule.handle(value, upstream)
        for ours, v in sets:
            _set(out, ours, v, key)
        entries.append(Entry(key, value, tuple(sets), rule.note))
    if "environment" not in upstream and "connector" not in out:
        out["connector"] = UPSTREAM_ENVIRONMENT
        entries.append(
            Entry("environment", None, (("connector", UPSTREAM_ENVIRONMENT),), "upstream's default")
        )
    if "max_gpu_budget" not in upstream and "gpu_budget" not in out:
        out["gpu_budget"] = UPSTREAM_MAX_GPU_BUDGET
        entries.append(
            Entry("max_gpu_budget", None, (("gpu_budget", UPSTREAM_MAX_GPU_BUDGET),), "upstream's default")
        )
    env = env or {}
    given = out.get("kubernetes", {})
    if out.get("connector") == "kubernetes" and isinstance(given, dict):  # else our check names it
        for ours, var in (("deployment", DGD_NAME_ENV), ("k8s_namespace", NAMESPACE_ENV)):
            if env.get(var) and ours not in given:
                out["kubernetes"] = given = {**given, ours: env[var]}
                entries.append(Entry(f"env {var}", env[var], ((f"kubernetes.{ours}", env[var]),), ""))
    return Translation(out, entries)


def mapping_table() -> list[tuple[str, str, str]]:
    """(upstream key, our key(s), note) for every upstream key we know, for ``config --mapping``."""
    return [(k, r.ours, r.note) for k, r in RULES.items()]
