"""Readiness and liveness of the worker.

The worker reports ready (runtime system status ``/health``, the ``dynamo_worker_ready`` metric) only
after the engine is up and the model is registered; an engine that dies while serving ends the worker
with its own exit code instead of leaving a registered instance that fails every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)

# The runtime's canary health check (when enabled) sends this through the normal handler.
HEALTH_CHECK_PAYLOAD: dict[str, Any] = {
    "token_ids": [1],
    "stop_conditions": {"max_tokens": 1},
    "sampling_options": {"temperature": 0.0},
}


class Readiness:
    """One flag, mirrored into the runtime's system status."""

    def __init__(self, runtime: Any = None) -> None:
        self.runtime = runtime
        self.ready = False

    def set(self, ready: bool) -> None:
        self.ready = ready
        if self.runtime is not None:
            with contextlib.suppress(Exception):
                self.runtime.set_health_status(ready)

    def __call__(self) -> bool:
        return self.ready


async def wait_engine_dead(engine: Any, poll_s: float = 1.0) -> None:
    """Return when vLLM reports its engine dead (EngineCore crashed or its output loop ended)."""
    while True:
        try:
            if engine.errored:
                log.error("vLLM engine is dead")
                return
        except Exception:  # engine object torn down
            return
        await asyncio.sleep(poll_s)
