"""What a client of the real 1.6.1 frontend sees when a decode worker's KV read failed, and when a worker
stops answering a request it acknowledged.

The worker's ``RequestHandler`` (decode mode; the engine is a stand-in that ends the request the way vLLM does
when the read failed: finish reason ``error``) is served on a real runtime endpoint behind a real
``python -m dynamo.frontend``. The worker raises ``HttpError(502, "KV transfer from prefill worker failed:
<peer>")``; the frontend keeps the text of a 5xx out of the client's answer (upstream's policy: a backend's
5xx text stays in the frontend's log), so the stage reaches the client as the number 502 only:
``details.backend_status`` without streaming, the SSE error frame's ``code`` with streaming.

A worker that hangs (SIGSTOP, a stuck engine) after acknowledging a request leaves it in flight for good
unless the frontend runs with upstream's ``DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS`` (unset upstream; our
launcher sets 300 s): with it the request ends with HTTP 504 once the answer was silent that long, while an
answer that keeps sending frames is never cut, however long it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.stall_meter import running_s
from dynamo_fpm_testing.worker_support import Proc, base_env, http_json, start_frontend, wait_until

pytest.importorskip("vllm")
pytestmark = pytest.mark.runtime

KV = {"remote_engine_id": "e1", "remote_host": "127.0.0.1", "remote_port": 5601, "do_remote_prefill": True}
PEER = "127.0.0.1:5601 (engine e1)"


class _FailedReadEngine:
    """vLLM's answer to a decode request whose KV read failed (``kv_load_failure_policy`` ``fail``)."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        from types import SimpleNamespace

        yield SimpleNamespace(
            finished=True,
            outputs=[SimpleNamespace(finish_reason="error", token_ids=[], index=0, stop_reason=None)],
        )

    async def abort(self, request_id: str) -> None:
        return None


def _sse_error(raw: str) -> dict[str, Any]:
    for line in raw.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            return dict(json.loads(line[len("data: ") :])["error"])
    raise AssertionError(f"no SSE error frame in {raw!r}")


@contextlib.asynccontextmanager
async def _served(
    tmp_path: Path,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Any,
    **frontend_env: str,
) -> AsyncIterator[tuple[str, Proc]]:
    """A real frontend (its own process) and ``serve`` on a runtime endpoint in this process, registered as an
    aggregated worker of the model ``tiny``: (base URL, the frontend) once the model is ready."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    discovery = tmp_path / "discovery"
    discovery.mkdir()
    env = base_env(discovery)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    frontend = start_frontend(port, {**env, **frontend_env}, tmp_path / "frontend.log")
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("dynamo.backend.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(serve))
    try:
        await asyncio.sleep(0.3)
        await register_model(
            ModelInput.Tokens,
            ModelType.Completions,
            endpoint,
            str(model_dir),
            "tiny",
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=32,
        )
        await asyncio.to_thread(
            wait_until, lambda: http_json(f"{base_url}/v1/models/tiny/ready", timeout=5)[0] == 200, 60
        )
        yield base_url, frontend
    finally:
        serving.cancel()
        runtime.shutdown()
        frontend.stop()


async def test_a_failed_kv_read_reaches_the_client_as_status_502(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo.vllm.drain import InflightTracker
    from dynamo.vllm.handlers import KV_TRANSFER_FAILED, RequestHandler

    handler = RequestHandler(_FailedReadEngine(), "decode", InflightTracker(), 100)

    async def serve(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        # The decode request of disaggregated serving: the frontend adds the prefill worker's KV parameters.
        request = {**request, "prefill_result": {"disaggregated_params": {"kv_transfer_params": KV}}}
        async for frame in handler.generate(request, context):
            yield frame

    async with _served(tmp_path, tiny_model_dir, monkeypatch, serve) as (base_url, frontend):
        # Unset here: our launcher's default bounds a silent answer (dynamo.frontend.main).
        assert "DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS=300)" in frontend.log()
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        url = f"{base_url}/v1/completions"
        status, answer = await asyncio.to_thread(http_json, url, body, 30)
        assert status == 500, answer
        assert answer["message"] == "Internal server error" and answer["details"] == {"backend_status": 502}

        status, raw = await asyncio.to_thread(http_json, url, {**body, "stream": True}, 30)
        assert status == 200, raw  # the SSE stream had begun: the error is a frame in it
        assert _sse_error(raw) == {"message": "Bad gateway", "type": "internal_server_error", "code": 502}

        # The text, with the peer, is in the frontend's log (and the worker's one line per failed request).
        logged = f"{KV_TRANSFER_FAILED}: {PEER}"
        await asyncio.to_thread(wait_until, lambda: frontend.log().count(logged) >= 2, 10)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_silent_acknowledged_request_ends_at_the_frontends_stream_timeout(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The worker takes the request and never answers (as a worker stopped mid-request does): the frontend
    ends it after ``DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS`` with 504 (and quarantines the worker)."""
    timeout_s = 2
    taken: list[float] = []

    async def serve(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        taken.append(time.monotonic())
        await asyncio.sleep(3600)
        yield {}

    async with _served(
        tmp_path, tiny_model_dir, monkeypatch, serve, DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS=str(timeout_s)
    ) as (base_url, _):
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        url = f"{base_url}/v1/completions"
        sent = time.monotonic()
        status, answer = await asyncio.to_thread(http_json, url, {**body, "stream": stream}, 60)
        took = running_s(sent, time.monotonic())
        assert taken and taken[-1] >= sent  # acknowledged: the worker had it
        assert timeout_s - 0.5 <= took <= timeout_s + 10, took
        if stream:
            assert status == 200 and _sse_error(answer)["code"] == 504, answer
        else:
            assert status == 504 and answer["message"] == "Request deadline exceeded", answer


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_the_stream_timeout_bounds_silence_not_the_whole_answer(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A worker that sends a token every ``gap_s`` (below the timeout) for longer than twice the timeout (the
    HTTP layer's own bound is twice the value): the answer completes. The 1.6.1 runtime's bound restarts at
    every frame, which is why the launcher can default it without cutting long generations."""
    timeout_s, gap_s, tokens = 4, 1.0, 10

    async def serve(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        for i in range(tokens):
            await asyncio.sleep(gap_s)
            frame: dict[str, Any] = {"token_ids": [100 + i]}
            if i == tokens - 1:
                frame["finish_reason"] = "length"
            yield frame

    async with _served(
        tmp_path, tiny_model_dir, monkeypatch, serve, DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS=str(timeout_s)
    ) as (base_url, _):
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": tokens, "stream": stream}
        sent = time.monotonic()
        status, answer = await asyncio.to_thread(http_json, f"{base_url}/v1/completions", body, 60)
        took = time.monotonic() - sent
        assert status == 200, answer
        assert took > 2 * timeout_s, took  # longer than either layer's bound, had it been a total
        if stream:
            assert "data: [DONE]" in answer and '"error"' not in answer, answer
            assert '"finish_reason":"length"' in answer.replace(" ", ""), answer
        else:
            assert answer["choices"][0]["finish_reason"] == "length", answer
