"""Prometheus metrics of the worker: the FPM publisher's counters, in-flight requests, readiness.

The publisher runs inside vLLM's EngineCore process (one per data-parallel rank) and writes its counters
as JSON to ``DYN_FPM_STATS_FILE`` about once a second; this collector reads those files at scrape time,
so the worker process exports them without sharing memory with the engine.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "dynamo_worker"
_COUNTERS = {
    "published": "FPM records published to NATS",
    "dropped": "FPM records dropped (queue full or NATS unavailable)",
    "heartbeats": "FPM idle heartbeats published",
    "reconnects": "NATS reconnects of the FPM publisher",
}
_RANK = re.compile(r"(\d+)")


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


class WorkerMetrics:
    """Owns the registry; serves it on a port and/or hands its text to the runtime's system server."""

    def __init__(self, collector: WorkerCollector) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.port: int | None = None
        self._server: Any = None

    def expfmt(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP exporter (0 = a free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
