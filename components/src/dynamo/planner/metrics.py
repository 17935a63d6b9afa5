"""Prometheus metrics of the planner (``--metrics-port``), in a registry of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dynamo.common.transport_state import TransportSnapshot
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .observations import Observation
from .policy import POOLS, Decision


class EngineQueueCollector(Collector):
    """Upstream's per-engine queue gauges (``worker_id``, ``dp_rank``) from the latest observation.

    Built at scrape time, not per tick (docs/metrics.md has the cost at 10,000 engines); engines gone
    from the book are gone from the next scrape."""

    FAMILIES = (
        ("dynamo_planner_engine_queued_prefill_tokens", "Queued prefill tokens per engine (from FPM)"),
        ("dynamo_planner_engine_queued_decode_kv_tokens", "Queued decode KV tokens per engine (from FPM)"),
        (
            "dynamo_planner_engine_inflight_decode_kv_tokens",
            "Inflight (scheduled) decode KV tokens per engine (from FPM)",
        ),
    )

    def __init__(self) -> None:
        self.latest: Observation | None = None

    def describe(self) -> Iterator[Any]:
        for name, doc in self.FAMILIES:
            yield GaugeMetricFamily(name, doc, labels=["worker_id", "dp_rank"])

    def collect(self) -> Iterator[Any]:
        families = [
            GaugeMetricFamily(name, doc, labels=["worker_id", "dp_rank"]) for name, doc in self.FAMILIES
        ]
        prefill, decode_kv, inflight = families
        obs = self.latest
        if obs is not None:
            for pool in (obs.prefill, obs.decode):
                for e in pool.engines:
                    key = [e.worker_id, str(e.dp_rank)]
                    queued = e.record.queued_requests
                    prefill.add_metric(key, queued.sum_prefill_tokens)
                    decode_kv.add_metric(key, queued.sum_decode_kv_tokens)
                    inflight.add_metric(key, e.record.scheduled_requests.sum_decode_kv_tokens)
        yield from families


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.current = Gauge(
            "dynamo_planner_current_replicas", "Replicas running per pool", ["pool"], registry=r
        )
        self.desired = Gauge(
            "dynamo_planner_desired_replicas", "Replicas the planner wants per pool", ["pool"], registry=r
        )
        self.workers = Gauge(
            "dynamo_planner_publishing_workers", "Workers seen publishing FPM", ["pool"], registry=r
        )
        self.load = Gauge("dynamo_planner_max_load", "Highest per-engine load signal", ["pool"], registry=r)
        self.decisions = Counter(
            "dynamo_planner_decisions", "Decisions by pool and action", ["pool", "action"], registry=r
        )
        self.records = Counter("dynamo_planner_records", "FPM records by outcome", ["outcome"], registry=r)
        self.apply_errors = Counter("dynamo_planner_apply_errors", "Connector calls that failed", registry=r)
        self.decide_seconds = Histogram(
            "dynamo_planner_decide_seconds",
            "Time to compute one decision",
            buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
            registry=r,
        )
        self.gpus = Gauge(
            "dynamo_planner_gpus_desired", "GPUs of the desired replicas, both pools", registry=r
        )
        # The FPM transport as the planner's tracker sees it (same names as the worker's publisher side).
        self.transport_connected = Gauge(
            "dynamo_fpm_transport_connected",
            "1 while the FPM transport (NATS) is connected",
            ["role"],
            registry=r,
        )
        self.transport_outages = Gauge(
            "dynamo_fpm_transport_outages", "Losses of the FPM transport so far", ["role"], registry=r
        )
        self.transport_down = Gauge(
            "dynamo_fpm_transport_down_seconds",
            "How long the current FPM transport outage has lasted (0 while connected)",
            ["role"],
            registry=r,
        )
        self.startup = Gauge(
            "dynamo_planner_startup_seconds",
            "Startup the pool is sized for: scale-up to the new replica's first record (assumed until timed)",
            ["pool"],
            registry=r,
        )
        self.startup_measured = Gauge(
            "dynamo_planner_startup_measured",
            "1 once the pool's startup has been measured; 0 while expected_startup_s stands in",
            ["pool"],
            registry=r,
        )
        self.evicted = Gauge(
            "dynamo_planner_evicted_engines",
            "Engines evicted from the planner's book because it was full (max_engines), so far",
            registry=r,
        )
        self._upstream_series()

    def _upstream_series(self) -> None:
        """Upstream Dynamo's planner names (``dynamo_planner_*`` on its dashboards), kept beside ours."""
        r = self.registry
        self.num_replicas = {
            p: Gauge(f"dynamo_planner_num_{p}_replicas", f"Current number of {p} replicas", registry=r)
            for p in POOLS
        }
        self.predicted_replicas = {
            p: Gauge(
                f"dynamo_planner_predicted_num_{p}_replicas", f"Decided number of {p} replicas", registry=r
            )
            for p in POOLS
        }
        self.gpu_hours = Gauge(
            "dynamo_planner_gpu_hours", "Cumulative GPU hours of the replicas running", registry=r
        )
        self.sla_target_ttft_ms = Gauge(
            "dynamo_planner_sla_target_ttft_ms",
            "Configured SLA target for time to first token (ms)",
            registry=r,
        )
        self.sla_target_itl_ms = Gauge(
            "dynamo_planner_sla_target_itl_ms",
            "Configured SLA target for inter-token latency (ms)",
            registry=r,
        )
        self.observed_rps = Gauge(
            "dynamo_planner_observed_requests_per_second",
            "Requests per second admitted by the frontends over the last interval (arrival source only)",
            registry=r,
        )
        self.observed_isl = Gauge(
            "dynamo_planner_observed_input_sequence_tokens",
            "Mean prompt length of the requests the frontends admitted (arrival source only)",
            registry=r,
        )
        self.engines = EngineQueueCollector()
        r.register(self.engines)
        self._gpu_hours = 0.0
        self._last_at: float | None = None

    def set_sla_targets(self, ttft_ms: float, itl_ms: float) -> None:
        self.sla_target_ttft_ms.set(ttft_ms)
        self.sla_target_itl_ms.set(itl_ms)

    def observe_engines(self, obs: Observation) -> None:
        """Keeps the latest observation; its per-engine series are built when scraped, not per tick."""
        self.engines.latest = obs
        if obs.arrivals is not None:
            self.observed_rps.set(obs.arrivals.requests_per_s)
            self.observed_isl.set(obs.arrivals.mean_isl)

    def observe_gpus_running(self, gpus_running: int, now: float) -> None:
        """Integrates the GPUs of the replicas running between ticks into ``dynamo_planner_gpu_hours``."""
        if self._last_at is not None and now > self._last_at:
            self._gpu_hours += gpus_running * (now - self._last_at) / 3600.0
        self._last_at = now
        self.gpu_hours.set(self._gpu_hours)

    def observe_transport(self, snap: TransportSnapshot, role: str = "tracker") -> None:
        self.transport_connected.labels(role).set(1.0 if snap.connected else 0.0)
        self.transport_outages.labels(role).set(snap.outages)
        self.transport_down.labels(role).set(snap.down_s)

    def observe(self, d: Decision, gpus: int, seconds: float) -> None:
        self.decide_seconds.observe(seconds)
        self.gpus.set(gpus)
        for p in ("prefill", "decode"):
            pd = d.pool(p)
            self.current.labels(p).set(pd.current)
            self.desired.labels(p).set(pd.desired)
            self.num_replicas[p].set(pd.current)
            self.predicted_replicas[p].set(pd.desired)
            self.workers.labels(p).set(pd.workers)
            if pd.load_max is not None:
                self.load.labels(p).set(pd.load_max)
            if pd.signals.lead_s is not None:
                self.startup.labels(p).set(pd.signals.lead_s)
                self.startup_measured.labels(p).set(1.0 if pd.signals.startup_measured else 0.0)
            self.decisions.labels(p, pd.action).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
