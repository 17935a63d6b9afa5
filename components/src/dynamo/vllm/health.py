"""Readiness and liveness of the worker.

The worker reports ready (runtime system status ``/health``, the ``dynamo_worker_ready`` metric) only
after the engine is up and the model is registered; an engine that dies while serving ends the worker
with its own exit code instead of leaving a registered instance that fails every request.

The FPM transport (NATS) is reported, not gated, by default: a worker whose records cannot reach NATS
still serves requests, so it stays ready and says so in its ``/health`` JSON and metrics
(``fpm_metrics``). With ``DYN_FPM_TRANSPORT_HEALTH=gate`` the runtime's health turns NotReady while the
transport has been disconnected for longer than ``DYN_FPM_TRANSPORT_GRACE`` seconds (default 5), and
Ready again when it is back (each change logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

# The runtime's canary health check (when enabled) sends this through the normal handler.
HEALTH_CHECK_PAYLOAD: dict[str, Any] = {
    "token_ids": [1],
    "stop_conditions": {"max_tokens": 1},
    "sampling_options": {"temperature": 0.0},
}


ENV_TRANSPORT_HEALTH = "DYN_FPM_TRANSPORT_HEALTH"
ENV_TRANSPORT_GRACE = "DYN_FPM_TRANSPORT_GRACE"
TRANSPORT_HEALTH_MODES = ("report", "gate")
DEFAULT_TRANSPORT_GRACE_S = 5.0


def transport_health_from_env(env: Mapping[str, str]) -> tuple[str, float]:
    """``(mode, grace seconds)``; raises ``ValueError`` naming the variable on a bad value."""
    mode = env.get(ENV_TRANSPORT_HEALTH, "").strip().lower() or "report"
    if mode not in TRANSPORT_HEALTH_MODES:
        raise ValueError(f"{ENV_TRANSPORT_HEALTH}={mode!r}: expected one of {TRANSPORT_HEALTH_MODES}")
    raw = env.get(ENV_TRANSPORT_GRACE, "").strip()
    try:
        grace = float(raw) if raw else DEFAULT_TRANSPORT_GRACE_S
    except ValueError:
        grace = -1.0
    if not grace >= 0:
        raise ValueError(f"{ENV_TRANSPORT_GRACE}={raw!r}: expected seconds (a number >= 0)")
    return mode, grace


class Readiness:
    """The engine's readiness, and (only when gated) the FPM transport's, mirrored into the runtime's
    system status; ``__call__`` is the engine's alone (``dynamo_worker_ready``)."""

    def __init__(self, runtime: Any = None) -> None:
        self.runtime = runtime
        self.ready = False
        self.transport_ok = True

    def set(self, ready: bool) -> None:
        self.ready = ready
        self._push()

    def set_transport(self, ok: bool) -> None:
        self.transport_ok = ok
        self._push()

    def healthy(self) -> bool:
        return self.ready and self.transport_ok

    def _push(self) -> None:
        if self.runtime is not None:
            with contextlib.suppress(Exception):
                self.runtime.set_health_status(self.healthy())

    def __call__(self) -> bool:
        return self.ready


async def gate_on_transport(
    readiness: Readiness,
    health: Callable[[], dict[str, Any]],
    *,
    grace_s: float = DEFAULT_TRANSPORT_GRACE_S,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """``DYN_FPM_TRANSPORT_HEALTH=gate``: NotReady while the FPM transport has been ``disconnected``
    for more than ``grace_s`` (``health()`` is the worker's ``/health`` state); runs until cancelled."""
    down_since: float | None = None
    while True:
        try:
            state = health().get("fpm_transport")
        except Exception:
            state = None
        now = clock()
        if state == "disconnected":
            down_since = now if down_since is None else down_since
            if readiness.transport_ok and now - down_since > grace_s:
                log.warning(
                    "health NotReady: the FPM transport has been down for %.1f s (%s=gate)",
                    now - down_since,
                    ENV_TRANSPORT_HEALTH,
                )
                readiness.set_transport(False)
        else:
            down_since = None
            if not readiness.transport_ok:
                log.warning("health Ready again: the FPM transport is back (%s=gate)", ENV_TRANSPORT_HEALTH)
                readiness.set_transport(True)
        await asyncio.sleep(poll_s)


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
