"""A standby worker for real: `python -m dynamo.vllm --standby` behind the real frontend on the tiny model.

It loads, stays invisible (the frontend has no model, no FPM record arrives), registers on SIGUSR1 in well
under a second and serves; SIGHUP parks it (unregistered, standing by again), SIGUSR1 brings it back, and
SIGTERM stops it with exit code 0. Its KV cache events (``--kv-events-config``) follow the registration: no
publisher while it stands by, one from SIGUSR1 until the park, a new one when it registers again.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common import worker_state as ws
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.common.ports import free_port, stable_free_port
from dynamo_fpm_testing.kv_routing import kv_events_config_json
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.worker_support import (
    base_env,
    complete,
    model_ready,
    start_frontend,
    start_worker,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "tiny"
KV_EVENTS_ON = "KV events for dp_rank=0"


def _state(path: Path) -> str | None:
    st = ws.read_state(path)
    return st.state if st is not None else None


async def _records_for(tracker: FpmTracker, seconds: float) -> list[Any]:
    await asyncio.sleep(seconds)
    return tracker.workers(include_stale=True)


async def test_standby_worker_registers_on_sigusr1_and_parks_on_sighup(
    tmp_path: Path, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> None:
    file_kv = tmp_path / "discovery"
    file_kv.mkdir()
    state_file = tmp_path / "worker.state.json"
    env = base_env(file_kv, nats_server.url, DYN_FPM_HEARTBEAT_INTERVAL="0.2")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    frontend = start_frontend(port, env, tmp_path / "frontend.log")
    worker = start_worker(
        tiny_model_dir,
        env,
        tmp_path / "worker.log",
        "--served-model-name",
        MODEL,
        "--standby",
        "--state-file",
        str(state_file),
        "--kv-events-config",
        kv_events_config_json(stable_free_port()),
    )
    tracker = FpmTracker("dynamo", nats_url=nats_server.url, stale_after=2.0)
    await tracker.start()
    procs = [worker, frontend]
    try:
        # Written before vLLM is imported: from then on SIGUSR1 is safe.
        wait_until(lambda: _state(state_file) is not None, 60, procs=procs)
        wait_until(lambda: _state(state_file) == ws.STANDBY, 300, procs=procs)
        # The state file is written before the log line: wait for the line, do not race it.
        wait_until(lambda: "standby:" in worker.log(), 10, procs=procs)
        # Invisible: no model behind the frontend, no FPM record (not even a heartbeat).
        assert not (await _records_for(tracker, 2.0))
        assert not model_ready(base_url, MODEL)
        assert KV_EVENTS_ON not in worker.log()

        t0 = time.monotonic()
        worker.signal(signal.SIGUSR1)
        wait_until(lambda: model_ready(base_url, MODEL), 20, interval=0.05, procs=procs)
        ready_after = time.monotonic() - t0
        assert _state(state_file) == ws.SERVING
        found = wait_until(lambda: re.search(r"registered in ([0-9.]+) s", worker.log()), 10, procs=procs)
        registered_in = float(found.group(1))
        assert registered_in < 1.0, worker.log()[-2000:]
        print(
            f"registered in {registered_in:.3f} s; the frontend served the model {ready_after:.2f} s after "
            "SIGUSR1"
        )
        out = complete(base_url, {"model": MODEL, "prompt": "hello there", "max_tokens": 4}, file_kv, procs)
        assert out["choices"][0]["text"]
        assert await _records_for(tracker, 1.0), "a registered worker publishes FPM"
        assert worker.log().count(KV_EVENTS_ON) == 1

        # Park: unregistered and standing by again.
        worker.signal(signal.SIGHUP)
        wait_until(lambda: _state(state_file) == ws.STANDBY, 60, procs=procs)
        wait_until(lambda: not model_ready(base_url, MODEL), 20, procs=procs)
        assert "parked:" in worker.log()
        assert "KV events stopped for 1 dp rank(s)" in worker.log()
        # ... and back.
        worker.signal(signal.SIGUSR1)
        wait_until(lambda: model_ready(base_url, MODEL), 20, interval=0.05, procs=procs)
        assert "registered again in" in worker.log()
        assert worker.log().count(KV_EVENTS_ON) == 2
        complete(base_url, {"model": MODEL, "prompt": "the cat", "max_tokens": 4}, file_kv, procs)

        worker.signal(signal.SIGTERM)
        assert worker.wait(90) == 0
    finally:
        await tracker.stop()
        worker.stop()
        frontend.stop()
