"""The ``local`` connector with a real `python -m dynamo.vllm` worker behind the real frontend (tiny model):
a warm standby promoted by a scale-up serves within a second, and a scale-down while a request streams lets
the request finish (SIGTERM to the worker alone: it drains, exits 0) - the signal to its whole process group
used to stop vLLM's engine under it and fail the request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from dynamo.common.ports import free_port
from dynamo.planner.connector_local import LocalConnector
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.stream_client import StreamingCompletion
from dynamo_fpm_testing.worker_support import (
    ENGINE_FLAGS,
    base_env,
    model_ready,
    start_frontend,
    until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = "tiny"


def _start_stream(base_url: str) -> StreamingCompletion:
    """400 tokens, read by a child process (a reader thread here could keep the event loop from the GIL)."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 400, "ignore_eos": True}
    stream = StreamingCompletion(base_url, body, started_after_chunks=3)
    assert stream.wait_started(60)
    return stream


async def test_promoted_standby_serves_and_a_scale_down_lets_its_request_finish(
    tmp_path: Path, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> None:
    file_kv = tmp_path / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_server.url)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    frontend = start_frontend(port, env, tmp_path / "frontend.log")
    template = " ".join(
        ["python", "-m", "dynamo.vllm", "--model", str(tiny_model_dir), "--served-model-name", MODEL,
         "--namespace", "{namespace}", *ENGINE_FLAGS]
    )  # fmt: skip
    c = LocalConnector(
        prefill_command="true",
        decode_command=template,
        log_dir=tmp_path / "logs",
        namespace="dynamo",
        stop_timeout_s=120,
        standby_decode=1,
        max_decode=1,
        env=env,
    )
    await c.start()
    try:
        await until(lambda: any(wp.warm for wp in c.standbys("decode")), "the standby never came up", 300)
        assert not model_ready(base_url, MODEL)  # a standby is invisible to the frontend
        t0 = time.monotonic()
        await c.apply(0, 1)
        await until(lambda: model_ready(base_url, MODEL), "the promoted standby never served", 20)
        ready_after = time.monotonic() - t0
        assert ready_after < 5.0, ready_after
        assert c.standbys("decode") == []  # at its maximum: no standby is loaded behind it
        worker = c.running("decode")[0]

        # Scale-down while a request streams, with no warm standby left: the worker is parked (it unregisters,
        # drains, stands by again) and the request finishes.
        stream = _start_stream(base_url)
        try:
            await c.apply(0, 0)
            assert worker.role == "parking"
            result = await asyncio.to_thread(stream.result, 180)
        finally:
            stream.close()
        assert (result.get("status"), result.get("tokens"), result.get("finish")) == (200, 400, "length"), (
            result
        )
        await until(lambda: c.poll() or worker.warm, "the worker was not parked", 60)
        # The worker writes its standby state, then logs the line: on a busy machine the line comes later.
        await until(lambda: "parked:" in worker.log_path.read_text(), "no parking logged", 10)

        # Promoted again; then the planner stops (close: SIGTERM to each worker alone) while a request
        # streams: the worker drains it and exits 0.
        await c.apply(0, 1)
        await until(lambda: model_ready(base_url, MODEL), "the parked worker never served again", 20)
        stream = _start_stream(base_url)
        try:
            await c.close()
            result = await asyncio.to_thread(stream.result, 180)
        finally:
            stream.close()
        assert (result.get("status"), result.get("tokens"), result.get("finish")) == (200, 400, "length"), (
            result
        )
        assert ("decode", worker.index, 0) in c.exited, c.exited  # every request finished: exit code 0
        print(
            f"promoted standby served {ready_after:.2f} s after apply(); parked and stopped with requests in "
            "flight"
        )
    finally:
        await c.close()
        frontend.stop()
