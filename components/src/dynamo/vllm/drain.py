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


class Outcome(enum.Enum):
    """How a tracked request ended (set by the request handler; ``FAILED`` unless it says otherwise)."""

    COMPLETED = "completed"  # the engine finished it (stop, length...)
    CANCELLED = "cancelled"  # its client went away
    REJECTED = "rejected"  # a bad request: nothing was cut
    HANDED_BACK = "handed_back"  # cut by the drain and ended with EngineShutdown: the frontend may migrate it
    FAILED = "failed"  # ended by an error without finishing


# Outcomes a drain counts as cut: the client did not get its whole answer from this worker.
CUT_OUTCOMES = frozenset({Outcome.HANDED_BACK, Outcome.FAILED})


class Tracked:
    """One request in flight; the handler sets ``outcome`` before it leaves ``InflightTracker.track``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outcome = Outcome.FAILED


class InflightTracker:
    """Counts requests being served; ``wait_idle`` resolves when none are left."""

    def __init__(self) -> None:
        self._active: set[str] = set()
        self._cut: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.accepting = True
        self.started_total = 0
        self.ended: dict[Outcome, int] = dict.fromkeys(Outcome, 0)

    @property
    def count(self) -> int:
        return len(self._active)

    def active_ids(self) -> list[str]:
        return sorted(self._active)

    def cut(self, request_id: str) -> None:
        """Mark a request the drain is about to abort: its handler hands it back instead of finishing it."""
        if request_id in self._active:
            self._cut.add(request_id)

    def was_cut(self, request_id: str) -> bool:
        return request_id in self._cut

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[Tracked]:
        tracked = Tracked(request_id)
        self._active.add(request_id)
        self.started_total += 1
        self._idle.clear()
        try:
            yield tracked
        finally:
            self.ended[tracked.outcome] += 1
            self._active.discard(request_id)
            self._cut.discard(request_id)
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
    """What the drain did, for the log line and the exit code.

    ``aborted`` counts every request that ended during the drain without its whole answer (handed back to the
    frontend at the grace period, or failed), however it was cut; ``handed_back`` is the part the drain itself
    ended at the grace period.
    """

    unregister_s: float
    waited_s: float
    inflight_at_start: int
    aborted: int
    completed: int = 0
    cancelled: int = 0
    handed_back: int = 0
    kv_waited_s: float = 0.0
    kv_given_up: int | None = None  # None: not a KV producer, or its pinned blocks could not be seen

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.DRAIN_TIMEOUT if self.aborted or self.kv_given_up else ExitCode.OK

    def summary(self) -> str:
        text = (
            f"{self.completed} completed, aborted {self.aborted} "
            f"({self.handed_back} at the grace period, handed back to the frontend to migrate), "
            f"{self.cancelled} cancelled by their clients"
        )
        if self.kv_given_up is not None:
            text += (
                f"; waited {self.kv_waited_s:.2f} s for KV blocks held for decode workers, "
                f"{self.kv_given_up} KV hand-off(s) given up"
            )
        return text


# Seconds a worker's drain keeps accepting requests after it unregistered: the frontend stops routing here
# ~25 ms after the unregister, and a request it routed just before is served rather than refused (a 503).
DRAIN_SETTLE_S = 0.5

# Seconds the drain waits at least for a fresh figure of the held KV blocks (the publisher writes it ~1/s).
KV_SAMPLE_WAIT_S = 2.5


def held_kv_reader(stats_template: str) -> Callable[[float], int | None]:
    """``pinned(since)``: finished requests whose KV blocks the engine still holds for a decode worker, summed
    over the engine's ranks, from the FPM publisher's stats files written after ``since`` (wall clock); None
    until every rank has written a fresh one."""
    from dynamo.vllm.fpm_env import STAT_KV_PINNED
    from dynamo.vllm.fpm_metrics import read_stats

    def pinned(since: float) -> int | None:
        stats = read_stats(stats_template)
        if not stats or any(float(data.get("time", 0.0)) <= since for data in stats.values()):
            return None
        return sum(int(data.get(STAT_KV_PINNED, 0)) for data in stats.values())

    return pinned


async def wait_kv_released(
    pinned: Callable[[float], int | None], deadline: float, interval_s: float = 0.1
) -> tuple[float, int | None]:
    """Wait (until the monotonic ``deadline``) for a prefill engine's KV hand-offs to end: the decode workers
    read the blocks, or vLLM's lease frees them. Returns (seconds waited, hand-offs left: given up; None if
    unseen)."""
    start = time.monotonic()
    since = time.time()
    left = pinned(since)
    while left != 0 and time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        left = pinned(since)
    return time.monotonic() - start, left


async def drain(
    tracker: InflightTracker,
    unregister: Callable[[], Awaitable[None]],
    abort: Callable[[str], Awaitable[None]],
    grace_s: float,
    held_kv: Callable[[float], int | None] | None = None,
    settle_s: float = 0.0,
) -> DrainReport:
    """Unregister, keep serving for ``settle_s`` (requests the frontend routed before it saw the unregister
    are served, not refused), then refuse new requests, wait up to ``grace_s`` for in-flight requests, cut
    the rest.

    A request cut at the grace period is aborted in vLLM and its handler ends it with ``EngineShutdown``,
    which the frontend migrates to another worker (``--migration-limit``) instead of returning a truncated
    answer.

    ``held_kv`` (a prefill worker's :func:`held_kv_reader`): then wait, within the same grace period but at
    least :data:`KV_SAMPLE_WAIT_S`, for the KV blocks vLLM still holds for decode workers that have not read
    them yet; stopping the engine under them fails those decode requests. What is left is counted as given up.
    """
    start = time.monotonic()
    inflight = tracker.count
    ended_before = dict(tracker.ended)
    if settle_s <= 0:
        tracker.accepting = False
    try:
        await unregister()
    except Exception as exc:  # keep draining: the lease expiry will remove us eventually
        log.warning("unregistering from discovery failed: %s", exc)
    unregistered = time.monotonic()
    if settle_s > 0:
        await asyncio.sleep(settle_s)
        tracker.accepting = False
        inflight = tracker.count
    log.info(
        "drain: unregistered in %.3f s, waiting for %d in-flight request(s)", unregistered - start, inflight
    )
    finished = await tracker.wait_idle(grace_s)
    if not finished:
        remaining = tracker.active_ids()
        log.warning(
            "drain: grace period of %.1f s expired, cutting %d request(s) (handed back to the frontend)",
            grace_s,
            len(remaining),
        )
        for request_id in remaining:
            tracker.cut(request_id)
            with contextlib.suppress(Exception):
                await abort(request_id)
        await tracker.wait_idle(5.0)
    kv_waited, kv_left = 0.0, None
    if held_kv is not None:
        deadline = max(start + grace_s, time.monotonic() + KV_SAMPLE_WAIT_S)
        kv_waited, kv_left = await wait_kv_released(held_kv, deadline)
        if kv_left is None:
            log.warning("drain: the engine's held KV blocks could not be read; not waiting for decode reads")
        elif kv_left:
            log.warning(
                "drain: %d KV hand-off(s) still held for decode workers after %.1f s: given up",
                kv_left,
                kv_waited,
            )
    ended = {outcome: tracker.ended[outcome] - ended_before[outcome] for outcome in Outcome}
    return DrainReport(
        unregister_s=unregistered - start,
        waited_s=time.monotonic() - unregistered,
        inflight_at_start=inflight,
        aborted=sum(ended[o] for o in CUT_OUTCOMES) + tracker.count,
        completed=ended[Outcome.COMPLETED],
        cancelled=ended[Outcome.CANCELLED],
        handed_back=ended[Outcome.HANDED_BACK],
        kv_waited_s=kv_waited,
        kv_given_up=kv_left,
    )
