"""What the policy sees, and the book that builds it from a stream of FPM records.

The book is plain Python with the clock passed in (no I/O), so the live loop and the offline replay
share it. It keeps the latest record per (pool, worker_id, dp_rank), drops workers that stopped
publishing, rejects malformed records (counted, with a reason), recognises restarts by a decreasing
``counter_id`` and keeps fresh or restarted workers out of the latency model until they are warm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, is_heartbeat

from .config import PlannerConfig
from .sla_model import LatencyModels, LinearFit

POOLS: tuple[str, str] = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Capacity:
    """One engine's limits; ``source`` says where they came from ("card", "config" or "none")."""

    context_length: int | None = None
    kv_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    source: str = "none"


class EngineObs(NamedTuple):
    """The latest record of one engine (worker_id, dp_rank) and what the planner knows about it.

    A NamedTuple, not a frozen dataclass: thousands are built per tick and this is cheaper.
    """

    worker_id: str
    dp_rank: int
    record: ForwardPassMetrics
    age_s: float
    warm: bool
    capacity: Capacity


@dataclass(frozen=True, slots=True)
class PoolObs:
    """One pool at one instant. ``replicas``: what the deployment runs (connector), else workers seen."""

    name: str
    engines: tuple[EngineObs, ...]
    replicas: int
    workers: int
    rejected: int = 0
    latency: LinearFit | None = None
    # Of ``replicas``, how many the connector says are still starting (None = it cannot tell).
    starting: int | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one decision needs. ``settled``: the connector reports its last action done."""

    now: float
    prefill: PoolObs
    decode: PoolObs
    settled: bool = True

    def pool(self, name: str) -> PoolObs:
        return self.prefill if name == "prefill" else self.decode


def record_problem(r: ForwardPassMetrics) -> str | None:
    """Why a record cannot be trusted, or None. Upstream planners froze on an empty worker_id."""
    if not r.worker_id:
        return "empty worker_id"
    if r.dp_rank < 0:
        return "negative dp_rank"
    if not math.isfinite(r.wall_time) or r.wall_time < 0:
        return "wall_time not a finite non-negative number"
    s, q = r.scheduled_requests, r.queued_requests
    for name in (
        "num_prefill_requests",
        "sum_prefill_tokens",
        "sum_prefill_kv_tokens",
        "num_decode_requests",
        "sum_decode_kv_tokens",
    ):
        if getattr(s, name) < 0:
            return f"negative scheduled {name}"
    for name in ("num_prefill_requests", "sum_prefill_tokens", "num_decode_requests", "sum_decode_kv_tokens"):
        if getattr(q, name) < 0:
            return f"negative queued {name}"
    parts = (
        q.num_decode_kv_transfer_requests,
        q.sum_decode_kv_transfer_tokens,
        q.num_decode_kv_ready_requests,
        q.sum_decode_kv_ready_tokens,
    )
    if any(p is not None and p < 0 for p in parts):
        return "negative decode transfer/ready split"
    if (q.num_decode_kv_transfer_requests or 0) + (
        q.num_decode_kv_ready_requests or 0
    ) > q.num_decode_requests:
        return "decode transfer + ready requests exceed queued decode requests"
    return None


@dataclass(slots=True)
class _Engine:
    record: ForwardPassMetrics
    first_seen: float
    last_seen: float
    timing_records: int = 0
    restarts: int = 0
    gaps: int = 0


@dataclass
class BookStats:
    accepted: int = 0
    heartbeats: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    gaps: int = 0
    dropped_stale: int = 0


class WorkerBook:
    """Latest record per engine per pool, plus warm-up, restarts, staleness and the latency model."""

    def __init__(self, cfg: PlannerConfig) -> None:
        self.cfg = cfg
        self._engines: dict[str, dict[tuple[str, int], _Engine]] = {p: {} for p in POOLS}
        self._cards: dict[str, dict[str, Capacity]] = {p: {} for p in POOLS}
        self._merged: dict[str, dict[str, Capacity]] = {p: {} for p in POOLS}
        self._rejected_since_snapshot: dict[str, int] = {p: 0 for p in POOLS}
        self.models = LatencyModels(cfg.sla.window)
        self.stats = BookStats()

    def pool_of(self, component: str) -> str | None:
        if component == self.cfg.prefill_component:
            return "prefill"
        if component == self.cfg.decode_component:
            return "decode"
        return None

    def ingest(self, pool: str, record: ForwardPassMetrics, now: float, *, restarted: bool = False) -> str:
        """Take one record (``restarted``: the subscriber saw a new publisher); returns what happened ("accepted", "heartbeat", "snapshot", "restart" or "rejected: ...")."""
        problem = record_problem(record)
        if problem is not None:
            self.stats.rejected[problem] = self.stats.rejected.get(problem, 0) + 1
            self._rejected_since_snapshot[pool] += 1
            return "rejected: " + problem
        key = (record.worker_id, record.dp_rank)
        engines = self._engines[pool]
        eng = engines.get(key)
        outcome = "accepted"
        if eng is None:
            eng = engines[key] = _Engine(record, now, now)
        else:
            last = eng.record.counter_id
            if record.counter_id < last or restarted:
                # A restarted publisher counts from zero again: a fresh engine, warm-up starts over.
                eng.first_seen, eng.timing_records = now, 0
                eng.restarts += 1
                self.stats.restarts += 1
                outcome = "restart"
            elif record.counter_id > last + 1:
                eng.gaps += record.counter_id - last - 1
                self.stats.gaps += record.counter_id - last - 1
            eng.record, eng.last_seen = record, now
        if record.wall_time > 0.0:
            if self._warm(eng, now):
                self.models.add(pool, record)
            eng.timing_records += 1
        elif outcome == "accepted":
            if is_heartbeat(record):
                self.stats.heartbeats += 1
                outcome = "heartbeat"
            else:
                outcome = "snapshot"  # queue snapshot: load signal, not a timing sample
        self.stats.accepted += 1
        return outcome

    def _warm(self, eng: _Engine, now: float) -> bool:
        return now - eng.first_seen >= self.cfg.warmup_s and eng.timing_records >= self.cfg.warmup_records

    def forget_worker(self, pool: str, worker_id: str) -> None:
        """A worker left discovery: drop all its ranks now rather than waiting for staleness."""
        engines = self._engines[pool]
        for key in [k for k in engines if k[0] == worker_id]:
            del engines[key]

    def set_card_capacity(self, pool: str, worker_id: str, cap: Capacity | None) -> None:
        if cap is None:
            self._cards[pool].pop(worker_id, None)
        else:
            self._cards[pool][worker_id] = cap
        self._merged[pool].pop(worker_id, None)

    def capacity_for(self, pool: str, worker_id: str) -> Capacity:
        """Model card values first; configuration fills what the card does not say (cached)."""
        merged = self._merged[pool]
        cap = merged.get(worker_id)
        if cap is None:
            cap = merged[worker_id] = self._capacity(pool, worker_id)
        return cap

    def _capacity(self, pool: str, worker_id: str) -> Capacity:
        conf = self.cfg.capacity
        card = self._cards[pool].get(worker_id)
        if card is None:
            if any(getattr(conf, k) is not None for k in ("context_length", "kv_tokens")):
                return Capacity(
                    conf.context_length,
                    conf.kv_tokens,
                    conf.max_num_batched_tokens,
                    conf.max_num_seqs,
                    "config",
                )
            return Capacity()
        return Capacity(
            card.context_length or conf.context_length,
            card.kv_tokens or conf.kv_tokens,
            card.max_num_batched_tokens or conf.max_num_batched_tokens,
            card.max_num_seqs or conf.max_num_seqs,
            "card",
        )

    def snapshot(
        self, pool: str, now: float, replicas: int | None = None, starting: int | None = None
    ) -> PoolObs:
        """The pool as the policy sees it; drops engines silent for ``stale_after_s``."""
        engines = self._engines[pool]
        stale_after = self.cfg.stale_after_s
        out: list[EngineObs] = []
        stale = []
        cap_for = self.capacity_for
        warm_s, warm_n = self.cfg.warmup_s, self.cfg.warmup_records
        for key, eng in engines.items():
            age = now - eng.last_seen
            if age > stale_after:
                stale.append(key)
                continue
            warm = now - eng.first_seen >= warm_s and eng.timing_records >= warm_n
            out.append(EngineObs(key[0], key[1], eng.record, age, warm, cap_for(pool, key[0])))
        for key in stale:
            del engines[key]
            self.stats.dropped_stale += 1
        workers = len({e.worker_id for e in out})
        rejected, self._rejected_since_snapshot[pool] = self._rejected_since_snapshot[pool], 0
        fit = self.models.prefill.fit() if pool == "prefill" else self.models.decode.fit()
        return PoolObs(
            pool, tuple(out), workers if replicas is None else replicas, workers, rejected, fit, starting
        )

    def observe(
        self,
        now: float,
        *,
        prefill_replicas: int | None = None,
        decode_replicas: int | None = None,
        settled: bool = True,
        prefill_starting: int | None = None,
        decode_starting: int | None = None,
    ) -> Observation:
        return Observation(
            now,
            self.snapshot("prefill", now, prefill_replicas, prefill_starting),
            self.snapshot("decode", now, decode_replicas, decode_starting),
            settled,
        )
