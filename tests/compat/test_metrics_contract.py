"""docs/metrics.md is the contract: a running planner serves every planner series it lists, and the
Grafana dashboard and PodMonitors in container/ read only what is listed, where it is served.
(The worker's series are scraped from a running worker in test_worker_e2e.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
import yaml
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.ports import free_port
from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.metrics_docs import base_name, documented_series, missing
from dynamo_fpm_testing.planner_support import rec

pytestmark = pytest.mark.timeout(120)

DASHBOARD = REPO / "container" / "grafana" / "dynamo-fpm-dashboard.json"
PODMONITOR = REPO / "container" / "k8s" / "podmonitor.yaml"
DGD = REPO / "container" / "k8s" / "dgd-disagg-planner.yaml"
PROMQL_WORDS = {"sum", "by", "max", "min", "rate", "histogram_quantile", "le", "avg", "without"}


def test_the_doc_lists_both_components() -> None:
    assert len(documented_series("Worker")) >= 15
    assert len(documented_series("Planner")) >= 20
    assert "dynamo_planner_num_decode_replicas" in documented_series("Planner")


def test_a_running_planner_serves_every_documented_series(nats_server: Any) -> None:
    ns, port = "metricsdoc", free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo.planner",
            "--namespace",
            ns,
            "--dry-run",
            "--interval",
            "0.3",
            "--no-tui",
            "--metrics-port",
            str(port),
            "--nats-url",
            nats_server.url,
            "--config",
            json.dumps({"use_model_cards": False, "capacity": {"context_length": 1000, "kv_tokens": 10000}}),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NATS_SERVER": nats_server.url},
        start_new_session=True,
    )
    pub = FpmDirectPublisher(namespace=ns, component="backend", worker_id="d0", nats_url=nats_server.url)
    record = rec("d0", wall=0.02, s_decode=4, s_decode_kv=2500, q_decode=30, q_decode_kv=9000)
    body, left = "", ["(no scrape yet)"]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            pub.publish(record)
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            left = missing(body, "Planner")
            if (
                not left
                and 'dynamo_planner_engine_queued_decode_kv_tokens{dp_rank="0",worker_id="d0"}' in body
            ):
                break
            time.sleep(0.2)
    finally:
        pub.close()
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert not left, f"documented but not served: {left}\n{err[-2000:]}"
    assert 'dynamo_planner_engine_queued_decode_kv_tokens{dp_rank="0",worker_id="d0"} 9000.0' in body


def _dashboard_series() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    names: set[str] = set()
    for expr in exprs:
        expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
        expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
        expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
            if word not in PROMQL_WORDS and (word.startswith(("dynamo_", "vllm:"))):
                names.add(base_name(word))
    return names


def test_the_dashboard_reads_only_documented_series() -> None:
    documented = {base_name(n) for n in documented_series("Worker") + documented_series("Planner")}
    used = _dashboard_series()
    assert len(used) >= 10, used
    assert used <= documented, f"dashboard series not in docs/metrics.md: {sorted(used - documented)}"


def test_the_podmonitors_scrape_ports_the_graph_opens() -> None:
    monitors = {d["metadata"]["name"]: d for d in yaml.safe_load_all(PODMONITOR.read_text()) if d}
    by_type = {
        m["spec"]["selector"]["matchLabels"]["nvidia.com/dynamo-component-type"]: m["spec"][
            "podMetricsEndpoints"
        ][0]
        for m in monitors.values()
    }
    assert set(by_type) == {"worker", "planner", "frontend"}
    assert all(
        m["spec"]["selector"]["matchLabels"]["nvidia.com/metrics-enabled"] == "true"
        for m in monitors.values()
    )
    assert (
        by_type["worker"]["port"] == "system"
    )  # the runtime's system server, where the worker adds its series
    dgd = next(d for d in yaml.safe_load_all(DGD.read_text()) if d and d["kind"] == "DynamoGraphDeployment")
    planner = next(c for c in dgd["spec"]["components"] if c["name"] == "planner")
    container = planner["podTemplate"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    cmd = container["command"]
    assert by_type["planner"]["port"] in ports, ports
    assert int(cmd[cmd.index("--metrics-port") + 1]) == ports[by_type["planner"]["port"]]
