"""End to end on the ZMQ event plane: our worker's records reach our tracker, the runtime's subscriber
and the watch CLI, field for field, and the runtime's tracking mode (what upstream's planner reads) lists the
worker (the "our worker" row of tests/compat/test_fpm_planes.py's matrix).

`python -m dynamo.frontend` + `python -m dynamo.vllm` on the tiny model with ``DYN_EVENT_PLANE=zmq`` and no
NATS server at all: the engine process binds its loopback PUB on a port the worker chose, the worker's
``FpmEventRelay`` puts the records on the plane, and discovery (file, in a temp folder) finds it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, decode
from dynamo.common.fpm_tracker import FpmTracker, record_to_dict
from dynamo.common.ports import free_port
from dynamo_fpm_testing.fpm_support import RuntimeReceiver
from dynamo_fpm_testing.worker_support import (
    Proc,
    base_env,
    complete,
    model_ready,
    start_frontend,
    start_worker,
    until,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

MODEL = "tiny"


@pytest.fixture(scope="module")
def zmq_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("worker-zmq")
    file_kv = work / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, None, DYN_EVENT_PLANE="zmq")
    env.pop("DYN_FORWARDPASS_METRIC_PORT", None)
    http_port = free_port()
    frontend = start_frontend(http_port, env, work / "frontend.log")
    worker = start_worker(tiny_model_dir, env, work / "worker.log", "--served-model-name", MODEL)
    try:
        base_url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: model_ready(base_url, MODEL), timeout=240, procs=[worker, frontend])
        found = re.search(r"worker (\d+) serving", worker.log())
        assert found, worker.log()[-3000:]
        yield {"base_url": base_url, "file_kv": file_kv, "worker": worker, "frontend": frontend,
               "worker_id": found.group(1), "env": env}  # fmt: skip
    finally:
        worker.stop()
        frontend.stop()


async def test_worker_publishes_on_the_zmq_plane(
    zmq_stack: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo.runtime import DistributedRuntime

    worker_id: str = zmq_stack["worker_id"]
    worker: Proc = zmq_stack["worker"]
    monkeypatch.setenv("DYN_FILE_KV", str(zmq_stack["file_kv"]))
    monkeypatch.delenv("NATS_SERVER", raising=False)
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    tracker = FpmTracker("dynamo", component="backend", event_plane="zmq", runtime=runtime)
    ours: list[ForwardPassMetrics] = []
    tracker.add_listener(lambda w, subject: ours.append(w.record))
    await tracker.start()
    theirs = RuntimeReceiver(runtime, "dynamo")
    from dynamo.llm import FpmEventSubscriber

    # What upstream 1.6.1's planner reads: tracking mode, only workers whose model card discovery lists.
    tracking = FpmEventSubscriber(runtime.endpoint("dynamo.backend.generate"))
    tracking.start_tracking()
    watch = subprocess.Popen(
        [sys.executable, "-m", "dynamo.common.recv_forward_pass_metrics", "--namespace", "dynamo",
         "--component", "backend", "--event-plane", "zmq", "--json"],
        env={**zmq_stack["env"], "DYN_LOG": "warn"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        # Idle heartbeats first: every subscriber has found the relay before the request runs.
        await until(lambda: any(r.worker_id == worker_id for r in ours), "a heartbeat in our tracker", 60)
        await until(lambda: any(r.worker_id == worker_id for r in theirs.records), "one in the runtime's", 60)
        await asyncio.sleep(2.0)  # the watch CLI's runtime finds it too (it started at the same time)
        body = {"model": MODEL, "prompt": "the cat sat on the", "max_tokens": 8, "temperature": 0}
        procs = [worker, zmq_stack["frontend"]]
        await asyncio.to_thread(complete, zmq_stack["base_url"], body, zmq_stack["file_kv"], procs)

        def timed(records: list[ForwardPassMetrics]) -> set[int]:
            return {r.counter_id for r in records if r.wall_time > 0}

        await until(lambda: timed(ours) & timed(theirs.records), "the same timing record in both", 30)
        await until(lambda: (worker_id, 0) in tracking.get_recent_stats(), "the worker in tracking mode", 30)
        tracked = decode(tracking.get_recent_stats()[(worker_id, 0)])
        await asyncio.sleep(1.5)  # at least one idle heartbeat after the request, for the watch CLI too
    finally:
        tracking.shutdown()
        theirs.stop()
        await tracker.stop()
        runtime.shutdown()
        watch.terminate()
        watched, watch_err = await asyncio.to_thread(watch.communicate, timeout=20)
    assert {r.worker_id for r in ours} == {worker_id}
    by_counter = {r.counter_id: r for r in theirs.records}
    both = [r for r in ours if r.counter_id in by_counter]
    assert any(r.wall_time > 0 for r in both)
    for r in both:
        assert r == by_counter[r.counter_id]  # field for field, extensions included
    assert any(r.scheduled_requests.num_prefill_requests == 1 for r in both if r.wall_time > 0)
    assert tracker.stats().rejected() == 0
    assert tracked is not None and tracked.worker_id == worker_id
    assert list(tracking.get_recent_stats()) == [(worker_id, 0)]
    lines = [json.loads(line) for line in watched.splitlines() if line.startswith("{")]
    mine = {d["counter_id"]: d for d in lines if d["worker_id"] == worker_id}
    assert mine, (watched[-2000:], watch_err[-2000:])
    for counter, d in mine.items():
        if counter in by_counter:
            want = record_to_dict(by_counter[counter])
            assert {k: d[k] for k in want} == want
    log = worker.log()
    relay = re.search(r"FPM relay for dp_rank=0: tcp://127\.0\.0\.1:(\d+)", log)
    assert relay and int(relay.group(1)) != 20380, log[-3000:]  # a port of this worker's own
    assert "on (zmq event plane)" in log
    assert not os.environ.get("NATS_SERVER")
