"""The whole planner with the ``local`` connector: it starts worker processes from a command template,
sees their FPM records on a real NATS server, scales decode up under a backlog, and stops a worker with
SIGTERM (it drains and exits 0) when traffic stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.planner.connector_local import LocalConnector
from dynamo.planner.loop import Planner
from dynamo.planner.policy import Decision
from dynamo_fpm_testing.planner_support import STAND_IN_FPM_WORKER, config
from dynamo_fpm_testing.stall_meter import Deadline

pytestmark = pytest.mark.timeout(150)


async def _until(cond: Any, what: str, timeout: float = 40.0) -> None:
    deadline = Deadline(timeout)
    while not cond():
        assert not deadline.expired(), f"{what} (waited {deadline.describe()})"
        await asyncio.sleep(0.1)


async def test_local_connector_in_the_loop(tmp_path: Path, nats_server: Any) -> None:
    ns = "planlocal"
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN_FPM_WORKER)
    control = tmp_path / "control.json"
    control.write_text("{}")
    template = f"python {script} {control} {{namespace}} {nats_server.url}"
    cfg = config(
        namespace=ns,
        interval_s=1.0,
        scale_down_stabilization_s=3.0,
        demand_window_s=3.0,
        mismatch_grace_s=20.0,
        stale_after_s=3.0,
        action_timeout_s=60.0,
        gpu_budget=3,
        use_model_cards=False,
        prefill={"min_replicas": 1, "max_replicas": 2},
        decode={"min_replicas": 1, "max_replicas": 2},
    )
    connector = LocalConnector(
        prefill_command=template,
        decode_command=template,
        log_dir=tmp_path / "logs",
        namespace=ns,
        stop_timeout_s=10,
    )
    await connector.start()
    decisions: list[Decision] = []
    planner = Planner(cfg, connector)
    planner.add_decision_listener(decisions.append)
    tracker = FpmTracker(ns, endpoint="generate", nats_url=nats_server.url, stale_after=cfg.stale_after_s)
    tracker.add_listener(planner.on_record)
    await tracker.start()
    stop = asyncio.Event()
    run = asyncio.create_task(planner.run(stop))
    try:
        # Nothing runs: both pools are below their minimum and get one worker each.
        def settled(p: int, d: int) -> bool:
            if not decisions:
                return False
            last = decisions[-1]
            obs = planner.book.observe(time.monotonic())
            return (
                (last.prefill.current, last.decode.current) == (p, d)
                and (obs.prefill.workers, obs.decode.workers) == (p, d)
                and planner.state.prefill.in_flight is None
                and planner.state.decode.in_flight is None
            )

        await _until(lambda: settled(1, 1), "pools never reached their minimum")
        assert decisions[0].prefill.reason.startswith("0 replicas, below min_replicas 1")

        # A decode backlog of requests waiting for remote KV.
        backlog = {
            "decode": {
                "scheduled": {"num_decode_requests": 4, "sum_decode_kv_tokens": 2500},
                "queued": {"num_decode_requests": 30, "sum_decode_kv_tokens": 9000},
            }
        }
        control.write_text(json.dumps(backlog))
        await _until(lambda: settled(1, 2), "decode never scaled up")
        ups = [d for d in decisions if d.decode.action == "scale_up" and d.decode.current == 1]
        assert ups and ups[0].decode.code == "load_up", [d.decode.code for d in ups]
        assert len(connector.running("decode")) == 2

        # Traffic stops: decode returns to its minimum; the stopped worker drains and exits 0.
        control.write_text("{}")
        await _until(lambda: settled(1, 1), "decode never scaled down")
        await _until(lambda: connector.draining() == 0, "worker did not exit")
        assert ("decode", 1, 0) in connector.exited
        assert "drained decode-1" in (tmp_path / "logs" / "decode-1.log").read_text()
        assert all(d.prefill.desired + d.decode.desired <= 3 for d in decisions)
        assert all(p + d <= 3 for _, p, d in planner.commands)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 5)
        await tracker.stop()
        await connector.close()
