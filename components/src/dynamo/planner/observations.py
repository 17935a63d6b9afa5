"""What the policy sees, and the book that builds it from a stream of FPM records.

The book is plain Python with the clock passed in (no I/O), so the live loop and the offline replay
share it. It keeps the latest record per (pool, worker_id, dp_rank), drops workers that stopped
publishing, rejects malformed records (counted, with a reason), recognises restarts by a decreasing
``counter_id`` and keeps fresh or restarted workers out of the latency model until they are warm.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, is_heartbeat
from dynamo.common.fpm_validate import record_problem as _record_problem

from .config import PlannerConfig
from .sla_model import LatencyModels, LinearFit

POOLS: tuple[str, str] = ("prefill", "decode")
NOT_IN_DISCOVERY = "not in discovery"


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

    # KV the engine holds for finished requests until a peer reads it or the lease ends (a prefill engine's
    # prompts for a dead or slow decode worker): capacity the engine cannot use. 0 when not reported.
    @property
    def held_kv_requests(self) -> int:
        return self.record.num_held_kv_requests or 0

    @property
    def held_kv_tokens(self) -> int:
        return self.record.sum_held_kv_tokens or 0

    @property
    def held_kv_age_s(self) -> float:
        """How long the oldest held KV has waited for its reader (seconds, as of the record)."""
        return self.record.max_held_kv_age or 0.0


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

    @property
    def held_kv_requests(self) -> int:
        """Requests whose KV the pool's engines hold for peers that have not read it (EngineObs)."""
        return sum(e.held_kv_requests for e in self.engines)

    @property
    def held_kv_tokens(self) -> int:
        """KV tokens the pool's engines hold for peers: taken from their capacity until read or leased out."""
        return sum(e.held_kv_tokens for e in self.engines)

    @property
    def max_held_kv_age_s(self) -> float:
        return max((e.held_kv_age_s for e in self.engines), default=0.0)


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Requests that reached the frontend over its last interval: how many per second, and their mean
    prompt length. The records show only what the engines hold and queue; an unsaturated prefill pool's
    records read load 0 however busy it is, so this is what says how much work keeps it busy."""

    requests_per_s: float
    mean_isl: float  # tokens
    window_s: float

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.requests_per_s * self.mean_isl


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one decision needs. ``settled``: the connector reports its last action done.
    ``arrivals``: the frontend's view of the traffic, when an arrival source is configured."""

    now: float
    prefill: PoolObs
    decode: PoolObs
    settled: bool = True
    arrivals: Arrivals | None = None

    def pool(self, name: str) -> PoolObs:
        return self.prefill if name == "prefill" else self.decode


def record_problem(r: ForwardPassMetrics, kv_tokens: int | None = None) -> str | None:
    """Why a record cannot be trusted, or None: the bounds of ``dynamo.common.fpm_validate`` (one place)."""
    return _record_problem(r, kv_tokens=kv_tokens)


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
    evicted: int = 0  # engines dropped because the book held max_engines (the stalest first)


class WorkerBook:
    """Latest record per engine per pool, plus warm-up, restarts, staleness and the latency model."""

    def __init__(self, cfg: PlannerConfig) -> None:
        self.cfg = cfg
        self._engines: dict[str, dict[tuple[str, int], _Engine]] = {p: {} for p in POOLS}
        self._cards: dict[str, dict[str, Capacity]] = {p: {} for p in POOLS}
        self._merged: dict[str, dict[str, Capacity]] = {p: {} for p in POOLS}
        self._rejected_since_snapshot: dict[str, int] = {p: 0 for p in POOLS}
        # Worker ids discovery lists per pool; None = no discovery source: every valid record counts.
        self._discovery: dict[str, frozenset[str] | None] = {p: None for p in POOLS}
        # Every engine of both pools, least recently updated first (eviction when max_engines is reached).
        self._recency: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self.models = LatencyModels(cfg.sla.window)
        self.stats = BookStats()

    def set_discovery(self, pool: str, worker_ids: frozenset[str] | set[str] | None) -> None:
        """The worker ids discovery vouches for (None: no discovery source). Records of others are
        rejected as "not in discovery"; engines already held that are no longer listed are dropped."""
        listed = None if worker_ids is None else frozenset(worker_ids)
        self._discovery[pool] = listed
        if listed is not None:
            for worker_id in {k[0] for k in self._engines[pool]} - listed:
                self.forget_worker(pool, worker_id)

    def discovery(self, pool: str) -> frozenset[str] | None:
        return self._discovery[pool]

    def engines_held(self) -> int:
        return len(self._recency)

    def has(self, pool: str, worker_id: str, dp_rank: int) -> bool:
        return (worker_id, dp_rank) in self._engines[pool]

    def _kv_tokens(self, pool: str, worker_id: str) -> int | None:
        """KV capacity for validation, without caching anything for ids the book does not hold."""
        card = self._cards[pool].get(worker_id)
        return (card.kv_tokens if card is not None else None) or self.cfg.capacity.kv_tokens

    def _reject(self, pool: str, problem: str) -> str:
        self.stats.rejected[problem] = self.stats.rejected.get(problem, 0) + 1
        self._rejected_since_snapshot[pool] += 1
        return "rejected: " + problem

    def _evict_stalest(self) -> None:
        (pool, worker_id, dp_rank), _ = self._recency.popitem(last=False)
        self._engines[pool].pop((worker_id, dp_rank), None)
        self.stats.evicted += 1

    def pool_of(self, component: str) -> str | None:
        if component == self.cfg.prefill_component:
            return "prefill"
        if component == self.cfg.decode_component:
            return "decode"
        return None

    def ingest(self, pool: str, record: ForwardPassMetrics, now: float, *, restarted: bool = False) -> str:
        """Take one record (``restarted``: the subscriber saw a new publisher); returns what happened
        ("accepted", "heartbeat", "snapshot", "restart" or "rejected: ...")."""
        listed = self._discovery[pool]
        if listed is not None and record.worker_id not in listed:
            return self._reject(pool, NOT_IN_DISCOVERY)
        problem = record_problem(record, self._kv_tokens(pool, record.worker_id))
        if problem is not None:
            return self._reject(pool, problem)
        key = (record.worker_id, record.dp_rank)
        engines = self._engines[pool]
        eng = engines.get(key)
        outcome = "accepted"
        recency_key = (pool, record.worker_id, record.dp_rank)
        if eng is None:
            while len(self._recency) >= max(1, self.cfg.max_engines):
                self._evict_stalest()
            eng = engines[key] = _Engine(record, now, now)
            self._recency[recency_key] = None
        else:
            self._recency.move_to_end(recency_key)
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
            self._recency.pop((pool, *key), None)

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
            self._recency.pop((pool, *key), None)
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
        arrivals: Arrivals | None = None,
    ) -> Observation:
        return Observation(
            now,
            self.snapshot("prefill", now, prefill_replicas, prefill_starting),
            self.snapshot("decode", now, decode_replicas, decode_starting),
            settled,
            arrivals,
        )
