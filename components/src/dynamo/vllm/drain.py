"""Graceful drain on SIGTERM: stop new work first, let in-flight requests finish, then stop.

Order matters for a planner's scale-down: unregistering the model and the endpoint instance removes the
worker from the frontend in milliseconds (a plain exit leaves it listed until its lease expires, ~10 s),
so no new request is routed here while the ones already running complete within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """Process exit codes of ``python -m dynamo.vllm`` (documented in docs/worker.md)."""

    OK = 0  # stopped by SIGTERM/SIGINT, every in-flight request finished
    STARTUP_FAILED = 1  # the runtime or the engine could not start, or an unexpected error
    BAD_ARGS = 2  # bad command line (one-line reason on stderr), nothing was started
    DRAIN_TIMEOUT = 3  # the grace period expired: remaining requests were aborted
    ENGINE_DIED = 4  # the vLLM engine died while serving


class InflightTracker:
    """Counts requests being served; ``wait_idle`` resolves when none are left."""

    def __init__(self) -> None:
        self._active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.accepting = True
        self.started_total = 0

    @property
    def count(self) -> int:
        return len(self._active)

    def active_ids(self) -> list[str]:
        return sorted(self._active)

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        self._active.add(request_id)
        self.started_total += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active.discard(request_id)
            if not self._active:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True if every request finished within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass
class DrainReport:
    """What the drain did, for the log line and the exit code."""

    unregister_s: float
    waited_s: float
    inflight_at_start: int
    aborted: int

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.DRAIN_TIMEOUT if self.aborted else ExitCode.OK


async def drain(
    tracker: InflightTracker,
    unregister: Callable[[], Awaitable[None]],
    abort: Callable[[str], Awaitable[None]],
    grace_s: float,
) -> DrainReport:
    """Refuse new requests, unregister, wait up to ``grace_s`` for in-flight requests, abort the rest."""
    tracker.accepting = False
    start = time.monotonic()
    inflight = tracker.count
    try:
        await unregister()
    except Exception as exc:  # keep draining: the lease expiry will remove us eventually
        log.warning("unregistering from discovery failed: %s", exc)
    unregistered = time.monotonic()
    log.info(
        "drain: unregistered in %.3f s, waiting for %d in-flight request(s)", unregistered - start, inflight
    )
    finished = await tracker.wait_idle(grace_s)
    aborted = 0
    if not finished:
        remaining = tracker.active_ids()
        aborted = len(remaining)
        log.warning("drain: grace period of %.1f s expired, aborting %d request(s)", grace_s, aborted)
        for request_id in remaining:
            with contextlib.suppress(Exception):
                await abort(request_id)
        await tracker.wait_idle(5.0)
    return DrainReport(
        unregister_s=unregistered - start,
        waited_s=time.monotonic() - unregistered,
        inflight_at_start=inflight,
        aborted=aborted,
    )
