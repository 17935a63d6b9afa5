"""The planner loop: observe (FPM tracker -> worker book) -> decide (pure policy) -> act (connector).

One tick per ``interval_s``. Every decision goes to the decision log and the metrics; the connector is
called only when a pool gets a new target (both pools' targets are sent, so external orchestrators
always see the full picture). A failed connector call clears that pool's in-flight state, so the
policy retries at the next interval instead of waiting for an action that never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from dynamo.common.rate_limited_log import RateLimitedWarning
from dynamo.common.transport_state import TransportSnapshot

from .arrivals import ArrivalSource
from .config import PlannerConfig
from .connector_base import Connector, ConnectorStatus
from .decision_log import DecisionLog, lines
from .metrics import PlannerMetrics
from .observations import Arrivals, WorkerBook
from .policy import POOLS, Decision, PolicyState, PoolName, decide, sent_now, settle
from .tui import CLEAR, render

logger = logging.getLogger(__name__)

REPOLL_S = 1.0  # a record from a worker id discovery does not list re-reads discovery at most this often


def _target(state: PolicyState, decision: Decision, pool: PoolName) -> int:
    """What the connector is asked for: the pool's new or pending target, else what it runs."""
    fl = state.pool(pool).in_flight
    return fl.target if fl is not None else decision.pool(pool).current


class Planner:
    def __init__(
        self,
        cfg: PlannerConfig,
        connector: Connector,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        log: DecisionLog | None = None,
        metrics: PlannerMetrics | None = None,
        cards: dict[str, Any] | None = None,
        transport: Callable[[], TransportSnapshot] | None = None,
        arrivals: ArrivalSource | None = None,
    ) -> None:
        self.cfg = cfg
        self.connector = connector
        self.clock = clock
        self.wall = wall
        self.log = log
        self.metrics = metrics
        self.cards = cards or {}
        self.book = WorkerBook(cfg)
        self.state = PolicyState()
        self.ticks = 0
        self.last: Decision | None = None
        self.last_status = ConnectorStatus()
        self.commands: list[tuple[float, int, int]] = []  # (clock, prefill, decode) sent
        self._restarts: dict[Any, int] = {}
        self._listeners: list[Callable[[Decision], None]] = []
        self._carded: dict[str, set[str]] = {}
        self._capped: dict[str, set[str]] = {}
        self._last_poll: float | None = None
        # The FPM transport's state (the tracker's ``transport``), for the metrics; None = not known.
        self.transport = transport
        # The frontend's arrival rate (``arrivals.py``); None = decide on the FPM records alone.
        self.arrivals = arrivals
        self._warn = RateLimitedWarning(logger, "planner rejected an FPM record")
        self._arrivals_warn = RateLimitedWarning(logger, "arrival source failed")

    # ------------------------------------------------------------------ observe
    def on_record(self, worker: Any, subject: str = "") -> None:
        """FpmTracker listener: one accepted record of any component of the namespace."""
        key = worker.key
        if key.endpoint != self.cfg.endpoint:
            return
        pool = self.book.pool_of(key.component)
        if pool is None:
            return
        now = self.clock()
        listed = self.book.discovery(pool)
        # A worker id discovery does not list may have registered since the last look: look again,
        # at most once a second.
        if (
            listed is not None
            and worker.record.worker_id not in listed
            and (self._last_poll is None or now - self._last_poll >= REPOLL_S)
        ):
            self._poll_cards()
        restarted = worker.restarts > self._restarts.get(key, worker.restarts)
        outcome = self.book.ingest(pool, worker.record, now, restarted=restarted)
        if outcome.startswith("rejected"):
            self._warn.warn(outcome.split(": ", 1)[-1])
        else:
            self._restarts[key] = worker.restarts
            if len(self._restarts) > 2 * max(1, self.cfg.max_engines):  # evicted or stale engines
                self._restarts = {
                    k: v
                    for k, v in self._restarts.items()
                    if (p := self.book.pool_of(k.component)) is not None
                    and self.book.has(p, k.worker_id, k.dp_rank)
                }
        if self.metrics is not None:
            self.metrics.records.labels(outcome.split(":")[0]).inc()

    def add_decision_listener(self, fn: Callable[[Decision], None]) -> None:
        self._listeners.append(fn)

    async def _read_arrivals(self, now: float) -> Arrivals | None:
        """The arrival source's reading; a failed read is logged and decided without (never fatal)."""
        if self.arrivals is None:
            return None
        try:
            return await self.arrivals.read(now)
        except Exception as exc:
            self._arrivals_warn.warn(f"{type(exc).__name__}: {exc}"[:160])
            return None

    def _poll_cards(self) -> None:
        """Discovery and capacity from model cards; a worker whose card vanished left discovery: drop it now.

        A source with ``listing()`` (the runtime's model cards) is a discovery source: only the worker ids
        it lists move the planner (``WorkerBook.set_discovery``). A source with only ``poll()`` gives
        capacity and nothing else is restricted (as without cards).
        """
        self._last_poll = self.clock()
        block = self.cfg.capacity.kv_block_size
        for pool, source in self.cards.items():
            listing_of = getattr(source, "listing", None)
            if listing_of is not None:
                listing = listing_of(block)
                if listing is None:  # discovery unreadable right now: keep what we knew
                    continue
                ids, caps = set(listing.worker_ids), listing.capacities
            else:
                caps = source.poll(block)
                ids = set(caps)
            for worker_id in self._carded.get(pool, set()) - ids:
                logger.info("%s worker %.256s left discovery", pool, worker_id)
                self.book.forget_worker(pool, worker_id)
            for worker_id in self._capped.get(pool, set()) - caps.keys():
                self.book.set_card_capacity(pool, worker_id, None)
            for worker_id, cap in caps.items():
                self.book.set_card_capacity(pool, worker_id, cap)
            if listing_of is not None:
                self.book.set_discovery(pool, ids)
            self._carded[pool] = ids
            self._capped[pool] = set(caps)

    # ------------------------------------------------------------------ decide + act
    async def tick(self) -> Decision:
        now = self.clock()
        self._poll_cards()
        try:
            status = await self.connector.status()
        except Exception as exc:
            logger.warning("connector status failed: %r", exc)
            status = ConnectorStatus(settled=False, detail=f"status failed: {exc!r}"[:200])
        self.last_status = status
        pb, db = status.breakdown("prefill"), status.breakdown("decode")
        arrivals = await self._read_arrivals(now)
        obs = self.book.observe(
            now,
            prefill_replicas=status.prefill,
            decode_replicas=status.decode,
            settled=status.settled,
            prefill_starting=None if pb is None else pb.starting,
            decode_starting=None if db is None else db.starting,
            arrivals=arrivals,
        )
        t0 = time.perf_counter()
        decision, state = decide(obs, self.state, self.cfg)
        spent = time.perf_counter() - t0
        applied = {"prefill": False, "decode": False}
        fresh = sent_now(state, now)
        if self.cfg.dry_run:
            state = settle(state, dry_run=True)  # nothing will happen: do not wait for it
        elif fresh:
            target = {p: _target(state, decision, p) for p in POOLS}
            try:
                await self.connector.apply(target["prefill"], target["decode"])
                self.commands.append((now, target["prefill"], target["decode"]))
                applied = {p: p in fresh for p in applied}
            except Exception as exc:
                logger.error(
                    "connector apply(prefill=%s, decode=%s) failed: %r",
                    target["prefill"],
                    target["decode"],
                    exc,
                )
                if self.metrics is not None:
                    self.metrics.apply_errors.inc()
                state = settle(state, failed=fresh)
        self.state = state
        self.ticks += 1
        self.last = decision
        if self.log is not None:
            self.log.write(
                lines(decision, ts=self.wall(), tick=self.ticks, applied=applied, dry_run=self.cfg.dry_run)
            )
        if self.metrics is not None:
            gpus = sum(
                decision.pool(p).desired * self.cfg.pool(p).gpus_per_replica for p in ("prefill", "decode")
            )
            self.metrics.observe(decision, gpus, spent)
            self.metrics.observe_engines(obs)
            self.metrics.observe_gpus_running(
                sum(decision.pool(p).current * self.cfg.pool(p).gpus_per_replica for p in POOLS), now
            )
            self.metrics.evicted.set(self.book.stats.evicted)
            if self.transport is not None:
                self.metrics.observe_transport(self.transport())
        if self.cfg.tui:
            sys.stderr.write(
                CLEAR
                + render(decision, status, self.book.stats, connector=self.connector.name, tick=self.ticks)
                + "\n"
            )
            sys.stderr.flush()
        for fn in self._listeners:
            fn(decision)
        return decision

    async def run(self, stop: asyncio.Event, *, max_ticks: int | None = None) -> None:
        """Tick every ``interval_s`` (drift-free) until ``stop`` is set.

        The first decision comes one interval after the start, so every live worker has published
        (records or heartbeats) before the planner judges the pools.
        """
        next_at = self.clock() + self.cfg.interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), self.cfg.interval_s)
        while not stop.is_set():
            await self.tick()
            if max_ticks is not None and self.ticks >= max_ticks:
                return
            next_at += self.cfg.interval_s
            delay = next_at - self.clock()
            if delay < 0:
                next_at = self.clock()
                delay = 0.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
