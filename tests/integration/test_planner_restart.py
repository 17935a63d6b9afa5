"""A planner killed with SIGKILL and started again: the worker its predecessor started is adopted, not
left running unseen next to a second one ("1 replicas but 2 workers publishing"), and the new planner's
SIGTERM stops it (the worker alone gets the signal and drains)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.planner.local_process import same_process_alive
from dynamo_fpm_testing.planner_support import STAND_IN_FPM_WORKER

pytestmark = pytest.mark.timeout(120)

CONFIG = {
    "use_model_cards": False,
    "prefill": {"min_replicas": 0, "max_replicas": 0},
    "decode": {"min_replicas": 1, "max_replicas": 2},
    "mismatch_grace_s": 5.0,
}


def _planner(tmp_path: Path, nats_url: str, template: str, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "dynamo.planner", "run", "--connector", "local", "--namespace", "restart",
        "--interval", "0.5", "--nats-url", nats_url, "--no-tui", "--config", json.dumps(CONFIG),
        "--prefill-command", template, "--decode-command", template, "--log-dir", str(tmp_path / "logs"),
        "--decision-log", str(tmp_path / "decisions.jsonl"),
    ]  # fmt: skip
    env = {**os.environ, "NATS_SERVER": nats_url}
    return subprocess.Popen(
        argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _until(cond: Any, what: str, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _workers(tmp_path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((tmp_path / "logs" / "local-connector.json").read_text())["workers"]
    except (OSError, ValueError, KeyError):
        return []


def test_a_restarted_planner_adopts_the_worker_its_killed_predecessor_started(
    tmp_path: Path, nats_server: Any
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN_FPM_WORKER)
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"decode": {"scheduled": {}, "queued": {}}}))  # an idle, publishing worker
    template = f"python {script} {control} {{namespace}} {nats_server.url}"
    log = tmp_path / "planner.log"
    first = _planner(tmp_path, nats_server.url, template, log)
    second = None
    try:
        _until(lambda: len(_workers(tmp_path)) == 1, "the first planner started no worker")
        worker = _workers(tmp_path)[0]
        _until(
            lambda: "started decode-0" in (tmp_path / "logs" / "decode-0.log").read_text(), "worker silent"
        )
        os.kill(first.pid, signal.SIGKILL)  # no clean-up at all
        first.wait(10)
        assert same_process_alive(worker["pid"], worker["started"])

        second = _planner(tmp_path, nats_server.url, template, log)
        _until(lambda: "adopted decode member 0" in log.read_text(), "the worker was not adopted")
        time.sleep(3.0)  # several decisions: the adopted worker is the pool's one replica
        assert [w["pid"] for w in _workers(tmp_path)] == [worker["pid"]]
        assert not (tmp_path / "logs" / "decode-1.log").exists()
        decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
        last = [d for d in decisions if d["pool"] == "decode"][-1]
        assert (last["current"], last["desired"]) == (1, 1), last

        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-3000:]
        assert not same_process_alive(worker["pid"], worker["started"])
        assert "drained decode-0" in (tmp_path / "logs" / "decode-0.log").read_text()
        assert _workers(tmp_path) == []
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for w in _workers(tmp_path):
            if same_process_alive(w["pid"], w["started"]):
                os.killpg(w["pid"], signal.SIGKILL)
