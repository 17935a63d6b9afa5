"""Prometheus metrics of the planner (``--metrics-port``), in a registry of its own."""

from __future__ import annotations

from dynamo.common.transport_state import TransportSnapshot
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .policy import Decision


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
        self.evicted = Gauge(
            "dynamo_planner_evicted_engines",
            "Engines evicted from the planner's book because it was full (max_engines), so far",
            registry=r,
        )

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
            self.workers.labels(p).set(pd.workers)
            if pd.load_max is not None:
                self.load.labels(p).set(pd.load_max)
            self.decisions.labels(p, pd.action).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
