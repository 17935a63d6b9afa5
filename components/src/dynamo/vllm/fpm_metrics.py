"""Prometheus metrics and ``/health`` of the worker: the FPM publisher's counters and transport state,
in-flight requests, readiness.

The publisher runs inside vLLM's EngineCore process (one per data-parallel rank) and writes its counters
as JSON to ``DYN_FPM_STATS_FILE`` about once a second; this collector reads those files at scrape time,
so the worker process exports them without sharing memory with the engine. A rank whose file is older
than ``TRANSPORT_STALE_S`` reads as transport state ``unknown`` (its engine process stopped writing).
"""

from __future__ import annotations

import glob
import http.server
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

PREFIX = "dynamo_worker"
_COUNTERS = {
    "published": "FPM records published to NATS",
    "dropped": "FPM records dropped (queue full or NATS unavailable)",
    "heartbeats": "FPM idle heartbeats published",
    "reconnects": "NATS reconnects of the FPM publisher",
}
_RANK = re.compile(r"(\d+)")
TRANSPORT_STALE_S = 5.0


def transport_state(data: dict[str, Any], now: float, stale_after: float = TRANSPORT_STALE_S) -> str:
    """``connected``, ``disconnected`` or ``unknown`` (stats file too old) for one rank's stats."""
    updated = data.get("time") or data.get("_mtime") or 0.0
    if now - float(updated) > stale_after:
        return "unknown"
    return "connected" if data.get("connected") else "disconnected"


def read_stats(template: str) -> dict[int, dict[str, Any]]:
    """Per-rank publisher counters from the files matching ``template`` (``{dp_rank}`` as the wildcard)."""
    pattern = template.replace("{dp_rank}", "*")
    prefix, _, suffix = template.partition("{dp_rank}")
    stats: dict[int, dict[str, Any]] = {}
    for path in glob.glob(pattern):
        middle = path[len(prefix) : len(path) - len(suffix)] if "{dp_rank}" in template else "0"
        match = _RANK.fullmatch(middle)
        if not match:
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            data["_mtime"] = os.path.getmtime(path)
        except (OSError, ValueError):
            continue  # being rewritten; the next scrape gets it
        if isinstance(data, dict):
            stats[int(match.group(1))] = data
    return stats


class WorkerCollector(Collector):
    """Collects at scrape time; ``inflight`` and ``ready`` are callables into the live worker."""

    def __init__(
        self,
        stats_template: str | None,
        inflight: Callable[[], int],
        ready: Callable[[], bool],
        labels: dict[str, str],
    ) -> None:
        self.stats_template = stats_template
        self.inflight = inflight
        self.ready = ready
        self.labels = labels

    def collect(self) -> Iterator[Any]:
        names = list(self.labels)
        values = [self.labels[n] for n in names]
        ready = GaugeMetricFamily(f"{PREFIX}_ready", "1 once the engine is up and registered", labels=names)
        ready.add_metric(values, 1.0 if self.ready() else 0.0)
        yield ready
        inflight = GaugeMetricFamily(f"{PREFIX}_inflight_requests", "Requests being served", labels=names)
        inflight.add_metric(values, float(self.inflight()))
        yield inflight
        stats = read_stats(self.stats_template) if self.stats_template else {}
        rank_names = [*names, "dp_rank"]
        for key, doc in _COUNTERS.items():
            family = CounterMetricFamily(f"{PREFIX}_fpm_{key}", doc, labels=rank_names)
            for rank, data in sorted(stats.items()):
                family.add_metric([*values, str(rank)], float(data.get(key) or 0))
            yield family
        queued = GaugeMetricFamily(
            f"{PREFIX}_fpm_queued", "FPM records waiting to be sent", labels=rank_names
        )
        connected = GaugeMetricFamily(
            f"{PREFIX}_fpm_connected", "1 while the FPM publisher is connected to NATS", labels=rank_names
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_fpm_stats_age_seconds", "Age of the publisher's last counter update", labels=rank_names
        )
        now = time.time()
        for rank, data in sorted(stats.items()):
            labels = [*values, str(rank)]
            queued.add_metric(labels, float(data.get("queued") or 0))
            connected.add_metric(labels, 1.0 if data.get("connected") else 0.0)
            updated = data.get("time") or data.get("_mtime") or now
            age.add_metric(labels, max(0.0, now - float(updated)))
        yield queued
        yield connected
        yield age
        role_names = [*rank_names, "role"]
        t_connected = GaugeMetricFamily(
            "dynamo_fpm_transport_connected",
            "1 while the FPM transport (NATS) is connected (0 when disconnected or the state is unknown)",
            labels=role_names,
        )
        t_outages = GaugeMetricFamily(
            "dynamo_fpm_transport_outages", "Losses of the FPM transport so far", labels=role_names
        )
        t_down = GaugeMetricFamily(
            "dynamo_fpm_transport_down_seconds",
            "How long the current FPM transport outage has lasted (0 while connected)",
            labels=role_names,
        )
        for rank, data in sorted(stats.items()):
            labels = [*values, str(rank), "publisher"]
            t_connected.add_metric(labels, 1.0 if transport_state(data, now) == "connected" else 0.0)
            t_outages.add_metric(labels, float(data.get("outages") or 0))
            t_down.add_metric(labels, float(data.get("down_s") or 0.0))
        yield t_connected
        yield t_outages
        yield t_down

    def health(self) -> dict[str, Any]:
        """Readiness plus the FPM transport: ``off`` (FPM disabled), ``unknown`` (no rank reported
        yet), ``connected`` (every rank), else ``disconnected`` (any rank disconnected or unknown)."""
        now = time.time()
        stats = read_stats(self.stats_template) if self.stats_template else {}
        ranks = {
            str(rank): {
                "state": transport_state(data, now),
                "down_s": float(data.get("down_s") or 0.0),
                "outages": int(data.get("outages") or 0),
            }
            for rank, data in sorted(stats.items())
        }
        if not self.stats_template:
            overall = "off"
        elif not ranks:
            overall = "unknown"
        elif all(r["state"] == "connected" for r in ranks.values()):
            overall = "connected"
        else:
            overall = "disconnected"
        return {
            "status": "ready" if self.ready() else "notready",
            "fpm_transport": overall,
            "fpm_ranks": ranks,
        }


class VllmMetricsCollector(Collector):
    """vLLM's own ``vllm:*`` series (its Prometheus stat logger writes them to the default registry of
    this process) passed through, so the dashboards built for vLLM work on the worker's port as they do
    on ``vllm serve``. The default registry's other families (process, GC) are left out."""

    def __init__(self, source: CollectorRegistry = REGISTRY, prefix: str = "vllm:") -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        for family in self.source.collect():
            if family.name.startswith(self.prefix):
                yield family


class WorkerMetrics:
    """Owns the registry; serves it on a port and/or hands its text to the runtime's system server."""

    def __init__(self, collector: WorkerCollector, vllm: Collector | None = None) -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.registry.register(VllmMetricsCollector() if vllm is None else vllm)
        self.port: int | None = None
        self._server: Any = None

    def expfmt(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP server (0 = a free port): ``/health`` as JSON (200 when ready, else 503),
        every other path the Prometheus exposition. Returns the bound port."""
        metrics_handler = MetricsHandler.factory(self.registry)
        health = self.collector.health

        # A base class made at run time (the factory binds the registry): mypy cannot check such a base.
        class Handler(metrics_handler):  # type: ignore[misc,valid-type]
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/health":
                    return super().do_GET()
                state = health()
                body = json.dumps(state).encode()
                self.send_response(200 if state["status"] == "ready" else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = http.server.ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True)
        thread.start()
        self._server = server
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
