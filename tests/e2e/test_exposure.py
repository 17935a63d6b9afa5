"""Metrics and health ports bind loopback unless ``DYN_SYSTEM_HOST`` (or ``--metrics-host``) opens them:
the planner's ``--metrics-port``, the worker's ``--metrics-port`` and the runtime's system server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.cli_setup import loopback_by_default
from dynamo.common.ports import free_port
from dynamo_fpm_testing.worker_support import (
    base_env,
    listening_addresses,
    low_free_port,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
CFG = json.dumps({"use_model_cards": False, "capacity": {"context_length": 1000, "kv_tokens": 10000}})


def _planner_binds(nats_url: str, tmp_path: Path, *extra: str, **env: str) -> set[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.planner", "--dry-run", "--nats-url", nats_url, "--no-tui",
         "--config", CFG, "--metrics-port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "planner.log", "w"),  # noqa: SIM115
        env={**{k: v for k, v in os.environ.items() if k != "DYN_SYSTEM_HOST"}, **env},
    )  # fmt: skip
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and proc.poll() is None:
            if found := listening_addresses(proc.pid, port):
                return found
            time.sleep(0.2)
        raise AssertionError((tmp_path / "planner.log").read_text()[-2000:])
    finally:
        proc.kill()
        proc.wait()


def test_planner_metrics_bind_loopback_unless_opened(nats_server: Any, tmp_path: Path) -> None:
    assert _planner_binds(nats_server.url, tmp_path) == {"127.0.0.1"}
    assert _planner_binds(nats_server.url, tmp_path, DYN_SYSTEM_HOST="0.0.0.0") == {"0.0.0.0"}
    assert _planner_binds(nats_server.url, tmp_path, "--metrics-host", "0.0.0.0") == {"0.0.0.0"}


def test_planner_reads_upstreams_metrics_port_variable() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "dynamo.planner", "config"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PLANNER_PROMETHEUS_PORT": "9085"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["metrics_port"] == 9085 and cfg["metrics_host"] is None


def test_loopback_by_default_keeps_a_value_given() -> None:
    env: dict[str, str] = {}
    assert loopback_by_default(env) == "127.0.0.1" and env == {"DYN_SYSTEM_HOST": "127.0.0.1"}
    env = {"DYN_SYSTEM_HOST": "0.0.0.0"}
    assert loopback_by_default(env) == "0.0.0.0"


@pytest.mark.vllm
def test_worker_ports_bind_all_interfaces_when_opened(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The default (loopback) is checked on test_worker_e2e.py's worker, which starts anyway."""
    kv = tmp_path / "kv"
    kv.mkdir()
    system, metrics = low_free_port(), free_port()
    env = base_env(kv, DYN_SYSTEM_PORT=str(system), DYN_SYSTEM_HOST="0.0.0.0")
    worker = start_worker(tiny_model_dir, env, tmp_path / "worker.log", "--metrics-port", str(metrics))
    try:
        want = {"0.0.0.0"}
        wait_until(
            lambda: listening_addresses(worker.pid, system) and listening_addresses(worker.pid, metrics),
            240,
            procs=[worker],
        )
        assert (
            listening_addresses(worker.pid, system) == want
            and listening_addresses(worker.pid, metrics) == want
        )
    finally:
        worker.stop()
