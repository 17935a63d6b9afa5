"""The ``local`` connector with a real `python -m dynamo.vllm` worker behind the real frontend (tiny model):
a warm standby promoted by a scale-up serves within a second, and a scale-down while a request streams lets
the request finish (SIGTERM to the worker alone: it drains, exits 0) - the signal to its whole process group
used to stop vLLM's engine under it and fail the request."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from dynamo.common.ports import free_port
from dynamo.planner.connector_local import LocalConnector
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.worker_support import (
    ENGINE_FLAGS,
    base_env,
    model_ready,
    sse_chunks,
    start_frontend,
    until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = "tiny"


def _stream(base_url: str, result: dict[str, Any], started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, finish, chunks = 0, None, 0
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=180) as r:
            result["status"] = r.status_code
            for chunk in sse_chunks(r.iter_lines()):
                chunks += 1
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunks >= 3:
                    started.set()
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    result.update(tokens=tokens, finish=finish)
    started.set()


def _start_stream(base_url: str) -> tuple[dict[str, Any], threading.Thread]:
    result: dict[str, Any] = {}
    started = threading.Event()
    thread = threading.Thread(target=_stream, args=(base_url, result, started))
    thread.start()
    assert started.wait(60), result
    return result, thread


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
        result, thread = _start_stream(base_url)
        await c.apply(0, 0)
        assert worker.role == "parking"
        await asyncio.to_thread(thread.join, 180)
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
        result, thread = _start_stream(base_url)
        await c.close()
        await asyncio.to_thread(thread.join, 180)
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
