"""What a client of the real 1.6.1 frontend sees when a decode worker's KV read failed.

The worker's ``RequestHandler`` (decode mode; the engine is a stand-in that ends the request the way vLLM does
when the read failed: finish reason ``error``) is served on a real runtime endpoint behind a real
``python -m dynamo.frontend``. The worker raises ``HttpError(502, "KV transfer from prefill worker failed:
<peer>")``; the frontend keeps the text of a 5xx out of the client's answer (upstream's policy: a backend's
5xx text stays in the frontend's log), so the stage reaches the client as the number 502 only:
``details.backend_status`` without streaming, the SSE error frame's ``code`` with streaming.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.worker_support import base_env, http_json, start_frontend, wait_until

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


async def test_a_failed_kv_read_reaches_the_client_as_status_502(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime
    from dynamo.vllm.drain import InflightTracker
    from dynamo.vllm.handlers import KV_TRANSFER_FAILED, RequestHandler

    discovery = tmp_path / "discovery"
    discovery.mkdir()
    env = base_env(discovery)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    frontend = start_frontend(port, env, tmp_path / "frontend.log")
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    handler = RequestHandler(_FailedReadEngine(), "decode", InflightTracker(), 100)

    async def serve(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        # The decode request of disaggregated serving: the frontend adds the prefill worker's KV parameters.
        request = {**request, "prefill_result": {"disaggregated_params": {"kv_transfer_params": KV}}}
        async for frame in handler.generate(request, context):
            yield frame

    endpoint = runtime.endpoint("dynamo.backend.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(serve))
    try:
        await asyncio.sleep(0.3)
        await register_model(
            ModelInput.Tokens,
            ModelType.Completions,
            endpoint,
            str(tiny_model_dir),
            "tiny",
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=32,
        )
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        url = f"{base_url}/v1/completions"
        await asyncio.to_thread(
            wait_until, lambda: http_json(f"{base_url}/v1/models/tiny/ready", timeout=5)[0] == 200, 60
        )

        status, answer = await asyncio.to_thread(http_json, url, body, 30)
        assert status == 500, answer
        assert answer["message"] == "Internal server error" and answer["details"] == {"backend_status": 502}

        status, raw = await asyncio.to_thread(http_json, url, {**body, "stream": True}, 30)
        assert status == 200, raw  # the SSE stream had begun: the error is a frame in it
        assert _sse_error(raw) == {"message": "Bad gateway", "type": "internal_server_error", "code": 502}

        # The text, with the peer, is in the frontend's log (and the worker's one line per failed request).
        logged = f"{KV_TRANSFER_FAILED}: {PEER}"
        await asyncio.to_thread(wait_until, lambda: frontend.log().count(logged) >= 2, 10)
    finally:
        serving.cancel()
        runtime.shutdown()
        frontend.stop()
