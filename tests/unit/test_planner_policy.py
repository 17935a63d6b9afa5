"""The pure policy on a table of scenarios, plus a simulated cluster for the multi-step guardrails."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from dynamo.planner.config import ConfigError, PlannerConfig, config_from_mapping
from dynamo.planner.observations import Arrivals, WorkerBook
from dynamo.planner.policy import (
    Decision,
    PolicyState,
    PoolState,
    PoolView,
    arrival_engines,
    decide,
)
from dynamo.planner.sla_model import LinearFit
from dynamo_fpm_testing.planner_support import CAP, KV, WATCHING, config, heartbeat, obs, pool, rec
from hypothesis import given, settings
from hypothesis import strategies as st

# --------------------------------------------------------------------------------------------------
# Single decisions.


def test_decode_backlog_waiting_for_remote_kv_scales_decode_not_prefill() -> None:
    """THE scenario: a disaggregated decode pool whose backlog sits in requests waiting for remote KV."""
    cfg = config()
    prefill = [rec("p0", s_prefill=1, s_prefill_tokens=200, q_prefill=1, q_prefill_tokens=300)]
    # Upstream-style records (no transfer/ready split): 9,000 KV tokens waiting for remote KV.
    decode = [rec("d0", s_decode=4, s_decode_kv=2500, q_decode=30, q_decode_kv=9000)]
    d, _ = decide(obs(100.0, prefill, decode), PolicyState(), cfg)
    assert (d.decode.action, d.decode.desired) == ("scale_up", 2), d.decode.reason
    assert d.prefill.action == "hold" and d.prefill.desired == d.prefill.current == 1, d.prefill.reason


def test_decode_backlog_ready_for_a_slot_scales_decode() -> None:
    cfg = config()
    decode = [
        rec(
            "d0",
            s_decode=4,
            s_decode_kv=6000,
            q_decode=20,
            q_decode_kv=6000,
            transfer=(0, 0),
            ready=(20, 6000),
        )
    ]
    d, _ = decide(obs(0.0, [rec("p0", q_prefill=1, q_prefill_tokens=10)], decode), PolicyState(), cfg)
    assert d.decode.action == "scale_up"
    assert d.prefill.action == "hold"


def test_slow_transfer_does_not_read_as_missing_decode_capacity() -> None:
    cfg = config()
    # Everything queued is still in transfer; nothing waits for a slot; the engine holds 30% of its KV.
    decode = [
        rec(
            "d0",
            s_decode=4,
            s_decode_kv=3000,
            q_decode=30,
            q_decode_kv=9000,
            transfer=(30, 9000),
            ready=(0, 0),
        )
    ]
    d, _ = decide(obs(0.0, [rec("p0", q_prefill=1, q_prefill_tokens=10)], decode), PolicyState(), cfg)
    assert d.decode.action == "hold", d.decode.reason
    assert d.decode.signals.transfer_bound_engines == 1
    assert d.prefill.action == "hold"
    # Same backlog but one request already waits for a slot: decode really is short.
    decode = [
        rec(
            "d0",
            s_decode=4,
            s_decode_kv=3000,
            q_decode=31,
            q_decode_kv=9100,
            transfer=(30, 9000),
            ready=(1, 100),
        )
    ]
    d, _ = decide(obs(0.0, [rec("p0", q_prefill=1, q_prefill_tokens=10)], decode), PolicyState(), cfg)
    assert d.decode.action == "scale_up"


def test_decode_slots_full_scales_decode_even_with_little_kv() -> None:
    """Many short requests: KV is nearly free, but every running slot (max_num_seqs) is taken."""
    cfg = config()
    slots = type(CAP)(context_length=1000, kv_tokens=10_000, max_num_seqs=16, source="card")
    full = rec(
        "d0", s_decode=16, s_decode_kv=900, q_decode=4, q_decode_kv=200, transfer=(0, 0), ready=(4, 200)
    )
    o = obs(0.0, [rec("p0", q_prefill=1, q_prefill_tokens=10)], [])
    o = type(o)(0.0, o.prefill, pool("decode", [full], capacity=slots))
    d, _ = decide(o, PolicyState(), cfg)
    assert d.decode.action == "scale_up" and d.decode.code == "load_up", d.decode.reason
    assert d.decode.signals.slot_load_max == 1.25
    # The same short requests still in transfer, with free slots: transfer-bound, not a slot shortage.
    moving = rec(
        "d0", s_decode=10, s_decode_kv=500, q_decode=10, q_decode_kv=500, transfer=(10, 500), ready=(0, 0)
    )
    o = type(o)(0.0, o.prefill, pool("decode", [moving], capacity=slots))
    d, _ = decide(o, PolicyState(), cfg)
    assert d.decode.action == "hold" and d.decode.signals.transfer_bound_engines == 1


def test_prefill_backlog_scales_prefill_not_decode() -> None:
    cfg = config()
    # 8 queued 1k prompts: 0.31 s of work at the 25.6k tokens/s this engine's pass shows, over half
    # the 500 ms TTFT target, so the queue is late (a queue of a few ms of work is not).
    prefill = [rec("p0", s_prefill=2, s_prefill_tokens=512, q_prefill=8, q_prefill_tokens=8000)]
    decode = [rec("d0", s_decode=4, s_decode_kv=3000)]
    d, _ = decide(obs(0.0, prefill, decode), PolicyState(), cfg)
    assert d.prefill.action == "scale_up" and d.prefill.desired == 2, d.prefill.reason
    assert d.prefill.signals.queue_wait_s == pytest.approx(8000 / 25_600, abs=1e-3)
    # A short queue (60 ms of work) while the frontend's arrivals bring 0.8 engines' worth: one engine
    # carries it, and the queue drains within the demand window.
    short = [rec("p0", s_prefill=2, s_prefill_tokens=512, q_prefill=2, q_prefill_tokens=1500)]
    o = replace(obs(0.0, short, decode), arrivals=Arrivals(0.8 * 25.6, 1000.0, 5.0))
    d, _ = decide(o, PolicyState(), cfg)
    assert d.prefill.action == "hold" and d.prefill.signals.arrival_engines == pytest.approx(0.8), (
        d.prefill.reason
    )
    assert d.decode.action == "hold"


def test_a_queue_on_one_engine_of_an_idle_pool_is_not_late() -> None:
    """The late rule reads the backlog spread over the pool. Mooncake's conversation trace (prompts up to
    126k tokens) queued one engine behind a long prompt while the others idled; a replica per tick, asked
    while that queue stood (it stays on its engine), took the pool 3 -> 6 and back within minutes."""
    cfg = config()
    arrivals = Arrivals(0.8 * 25.6, 1000.0, 5.0)  # 0.8 engines' worth
    busy = rec("p0", s_prefill=2, s_prefill_tokens=512, q_prefill=8, q_prefill_tokens=8000)  # 0.31 s queued
    idle = [rec(f"p{i}", s_prefill=1, s_prefill_tokens=100) for i in (1, 2)]
    decode = [rec("d0", s_decode=4, s_decode_kv=3000)]
    o = replace(obs(0.0, [busy, *idle], decode), arrivals=arrivals)
    d, _ = decide(o, WATCHING, cfg)
    assert d.prefill.action != "scale_up" and "queue waits" not in d.prefill.reason, d.prefill.reason
    assert d.prefill.signals.queue_wait_s == pytest.approx(8000 / 25_600, abs=1e-3)  # the longest, as before
    assert d.prefill.signals.late_engines == 1  # 0.31 s over half the 500 ms target, on one engine of three
    # The same queue on every engine: the pool is short, one replica more.
    queued = [
        rec(f"p{i}", s_prefill=2, s_prefill_tokens=512, q_prefill=8, q_prefill_tokens=8000) for i in range(3)
    ]
    d, _ = decide(replace(obs(0.0, queued, decode), arrivals=arrivals), WATCHING, cfg)
    assert d.prefill.action == "scale_up" and d.prefill.desired == 4, d.prefill.reason
    assert d.prefill.reason.endswith("a queue waits over half the TTFT target"), d.prefill.reason
    assert d.prefill.signals.late_engines == 3


def test_capacity_unknown_holds_with_reason() -> None:
    cfg = config(capacity={})
    unknown = pool("decode", [rec("d0", s_decode=4, s_decode_kv=3000)], capacity=type(CAP)())
    o = obs(0.0, [rec("p0", q_prefill=1, q_prefill_tokens=10)], [])
    o = type(o)(
        o.now, pool("prefill", [rec("p0", q_prefill=1, q_prefill_tokens=10)], capacity=type(CAP)()), unknown
    )
    d, _ = decide(o, PolicyState(), cfg)
    assert d.decode.action == "hold" and "capacity unknown (kv_tokens)" in d.decode.reason
    assert "capacity unknown (context_length)" in d.prefill.reason


def test_replicas_not_publishing_hold_then_count_against_scale_down() -> None:
    cfg = config()
    low = [rec("d0", s_decode=1, s_decode_kv=100)]
    state = PolicyState()
    d, state = decide(obs(0.0, [heartbeat("p0")], low, decode_replicas=2), state, cfg)
    assert d.decode.action == "hold" and "2 replicas but 1 workers publishing" in d.decode.reason
    # After the grace: decides, but the silent replica counts as busy, so no scale-down ever.
    for t in range(10, 100, 5):
        d, state = decide(obs(float(t), [heartbeat("p0")], low, decode_replicas=2), state, cfg)
        assert d.decode.action == "hold", d.decode.reason
    assert "1 silent engines counted at 1" in d.decode.reason
    # A scale-up is still allowed on what the present workers say.
    high = [rec("d0", s_decode=10, s_decode_kv=20000)]
    d, state = decide(obs(105.0, [heartbeat("p0")], high, decode_replicas=2), state, cfg)
    assert d.decode.action == "scale_up" and d.decode.desired >= 3  # proportional: may add several


def test_silence_from_every_replica_is_not_idleness() -> None:
    """All workers silent (NATS down, tracker cut off): hold, never "traffic stopped -> minimum"."""
    cfg = config()
    state = PolicyState()
    for t in range(0, 120, 5):
        d, state = decide(obs(float(t), [], [], prefill_replicas=3, decode_replicas=3), state, cfg)
        assert d.prefill.action == d.decode.action == "hold", (d.prefill.reason, d.decode.reason)
    assert "3 of 3 replicas not publishing" in d.decode.reason


def test_above_maximum_steps_down() -> None:
    decode = [rec(f"d{i}", s_decode=8, s_decode_kv=12000) for i in range(6)]  # overloaded, but over max 4
    d, _ = decide(obs(0.0, [heartbeat("p0")], decode), PolicyState(), config())
    assert (d.decode.action, d.decode.desired) == (
        "scale_down",
        5,
    ) and "above max_replicas 4" in d.decode.reason


def test_below_minimum_steps_up() -> None:
    d, _ = decide(obs(0.0, [], [heartbeat("d0")], prefill_replicas=0), PolicyState(), config())
    assert (d.prefill.action, d.prefill.desired) == ("scale_up", 1)
    assert "below min_replicas 1" in d.prefill.reason


def test_a_scale_down_removes_whole_workers_with_all_their_ranks() -> None:
    """Two workers with two dp ranks each: one worker (two engines) is what a scale-down removes."""
    cfg = config(scale_down_stabilization_s=0.0)
    # Four engines at 0.35: 1.4 engines of demand, 1.65 at the 0.85 target: one worker's two engines carry it.
    low = [rec(f"d{w}", dp_rank=r, s_decode=1, s_decode_kv=3500) for w in range(2) for r in range(2)]
    d, _ = decide(obs(0.0, [heartbeat("p0")], low), WATCHING, cfg)
    assert (d.decode.action, d.decode.desired, d.decode.code) == ("scale_down", 1, "load_down")
    # At 0.45 each: 1.8 engines, 2.1 at the target: more than one worker's two engines, so both stay.
    mid = [rec(f"d{w}", dp_rank=r, s_decode=1, s_decode_kv=4500) for w in range(2) for r in range(2)]
    d, _ = decide(obs(0.0, [heartbeat("p0")], mid), WATCHING, cfg)
    assert (d.decode.action, d.decode.code) == ("hold", "load_steady"), d.decode.reason


def test_malformed_records_are_rejected_and_reported() -> None:
    cfg = config()
    book = WorkerBook(cfg)
    assert book.ingest("decode", rec(""), 0.0) == "rejected: empty worker_id"
    assert book.ingest("decode", rec("d0", q_decode_kv=-5), 0.0).startswith("rejected: negative")
    assert book.ingest("decode", rec("d0", wall=float("nan")), 0.0).startswith("rejected: wall_time")
    bad_split = rec("d0", q_decode=1, q_decode_kv=10, transfer=(1, 5), ready=(1, 5))
    assert book.ingest("decode", bad_split, 0.0).startswith("rejected: decode transfer + ready")
    assert book.ingest("decode", rec("d0", s_decode=1, s_decode_kv=100), 0.0) == "accepted"
    o = book.observe(0.5)
    assert o.decode.rejected == 4 and o.decode.workers == 1
    d, _ = decide(o, PolicyState(), cfg)
    assert d.decode.signals.rejected_records == 4
    assert book.observe(0.6).decode.rejected == 0  # counted once


def test_stale_worker_is_dropped_and_restart_recognised() -> None:
    cfg = config(stale_after_s=5.0, warmup_s=1.0, warmup_records=2)
    book = WorkerBook(cfg)
    for i in range(1, 6):
        book.ingest("decode", rec("d0", counter=i, s_decode=2, s_decode_kv=100 * i), float(i))
    assert book.observe(5.5).decode.engines[0].warm
    assert book.ingest("decode", rec("d0", counter=1, s_decode=2, s_decode_kv=50), 6.0) == "restart"
    eng = book.observe(6.1).decode.engines[0]
    assert not eng.warm and book.stats.restarts == 1
    assert book.observe(11.5).decode.workers == 0  # silent for more than stale_after_s
    assert book.stats.dropped_stale == 1


def test_heartbeats_and_queue_snapshots_are_not_timing_samples_and_cold_workers_do_not_train() -> None:
    cfg = config(warmup_s=10.0, warmup_records=3)
    book = WorkerBook(cfg)
    # Cold-start records of a fresh worker (slow first passes) must not reach the model.
    for i in range(1, 4):
        assert (
            book.ingest("decode", rec("d0", counter=i, wall=5.0, s_decode=1, s_decode_kv=10), float(i))
            == "accepted"
        )
    assert len(book.models.decode) == 0
    assert book.ingest("decode", heartbeat("d0", 4), 12.0) == "heartbeat"
    snapshot = rec("d0", counter=5, wall=0.0, q_decode=3, q_decode_kv=300)
    assert book.ingest("decode", snapshot, 12.5) == "snapshot"
    assert len(book.models.decode) == 0
    book.ingest("decode", rec("d0", counter=6, wall=0.02, s_decode=1, s_decode_kv=10), 13.0)
    assert len(book.models.decode) == 1


def test_capacity_from_model_card_wins_over_config() -> None:
    cfg = config(capacity={"context_length": 100, "kv_tokens": 100, "max_num_seqs": 8})
    book = WorkerBook(cfg)
    book.set_card_capacity("decode", "d0", type(CAP)(context_length=4096, kv_tokens=65536, source="card"))
    c = book.capacity_for("decode", "d0")
    assert (c.kv_tokens, c.context_length, c.max_num_seqs, c.source) == (65536, 4096, 8, "card")
    assert book.capacity_for("decode", "d1").kv_tokens == 100


def test_sla_target_uses_online_regression() -> None:
    cfg = config(
        target="sla", sla={"itl_ms": 30.0, "ttft_ms": 1000.0, "min_samples": 5}, warmup_s=0, warmup_records=0
    )
    book = WorkerBook(cfg)
    # wall = 5 ms + 0.002 ms per KV token.
    for i in range(1, 40):
        kv = 500 * i
        book.ingest(
            "decode",
            rec("d0", counter=i, wall=0.005 + kv * 2e-6, s_decode=1 + i % 7, s_decode_kv=kv),
            i * 0.1,
        )
    book.ingest("decode", rec("d0", counter=40, wall=0.037, s_decode=20, s_decode_kv=16000), 4.0)  # ITL 37 ms
    book.ingest("prefill", heartbeat("p0"), 4.0)
    d, _ = decide(book.observe(4.1), PolicyState(), cfg)
    assert d.decode.action == "scale_up", d.decode.reason
    sig = d.decode.signals
    assert sig.samples is not None and sig.samples >= 39
    assert sig.itl_est_s is not None and sig.itl_est_s.max == pytest.approx(0.005 + 16000 * 2e-6, rel=0.05)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^decode\.max_replicas"):
        config_from_mapping({"decode": {"min_replicas": 3, "max_replicas": 2}})
    with pytest.raises(ConfigError, match=r"^prefill\.maxreplicas: unknown option"):
        config_from_mapping({"prefill": {"maxreplicas": 2}})
    with pytest.raises(ConfigError, match=r"^interval_s: expected a number"):
        config_from_mapping({"interval_s": "fast"})
    with pytest.raises(ConfigError, match=r"^target: 'fast' is not one of"):
        config_from_mapping({"target": "fast"})
    with pytest.raises(ConfigError, match=r"^gpu_budget"):
        config_from_mapping({"gpu_budget": 1})
    with pytest.raises(ConfigError, match=r"^thresholds: target 'load'"):
        config_from_mapping({"target": "load"})
    with pytest.raises(ConfigError, match=r"^thresholds\.decode_down"):
        config_from_mapping({"target": "load", "thresholds": {"decode_up": 0.5, "decode_down": 0.7}})


def test_policy_is_pure_and_fast() -> None:
    cfg = config()
    o = obs(
        1.0,
        [rec(f"p{i}", q_prefill_tokens=100) for i in range(1000)],
        [rec(f"d{i}", s_decode_kv=5000) for i in range(1000)],
    )
    a = decide(o, PolicyState(), cfg)
    assert a == decide(o, PolicyState(), cfg)
    t = time.perf_counter()
    for _ in range(10):
        decide(o, PolicyState(), cfg)
    assert (time.perf_counter() - t) / 10 < 0.010


# --------------------------------------------------------------------------------------------------
# A simulated cluster: the connector enacts a decision after ``delay`` ticks; a scale-down drains
# (keeps its GPUs) for ``delay`` ticks. Loads are functions of (tick, pool) -> total demand.


@dataclass
class Sim:
    cfg: PlannerConfig
    prefill: int
    decode: int
    delay: int = 1
    never_ready: set[str] = field(default_factory=set)
    t: float = 0.0
    state: PolicyState = field(default_factory=PolicyState)
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)  # pool -> (target, ticks left)
    history: list[Decision] = field(default_factory=list)
    max_gpus: int = 0
    silent_drain: bool = False  # a draining replica stops publishing at once (still holds its GPUs)

    def running(self, name: str) -> int:
        return getattr(self, name)

    def records(self, name: str, demand: float) -> list:
        n = self.reported(name) if self.silent_drain else self.running(name)
        if n == 0:
            return []
        share = demand / n
        if name == "prefill":
            return [
                rec(f"p{i}", q_prefill=1 if share else 0, q_prefill_tokens=int(share * 1000))
                for i in range(n)
            ]
        return [rec(f"d{i}", s_decode=1 if share else 0, s_decode_kv=int(share * KV)) for i in range(n)]

    def reported(self, name: str) -> int:
        """Replicas as a local connector reports them: a draining replica is no longer counted."""
        n = self.running(name)
        if name in self.pending and self.pending[name][0] < n:
            return self.pending[name][0]
        return n

    def tick(self, prefill_demand: float, decode_demand: float) -> Decision:
        o = obs(
            self.t,
            self.records("prefill", prefill_demand),
            self.records("decode", decode_demand),
            prefill_replicas=self.reported("prefill"),
            decode_replicas=self.reported("decode"),
            settled=not self.pending,
        )
        d, self.state = decide(o, self.state, self.cfg)
        self.history.append(d)
        for name in ("prefill", "decode"):
            fl = self.state.pool(name).in_flight
            if fl is not None and fl.since == self.t:  # a new command this tick
                self.pending[name] = (fl.target, self.delay)
        # GPUs held: running + starting (pending up) ; draining ones are still in ``running``.
        gpus = 0
        for name in ("prefill", "decode"):
            n = self.running(name)
            if name in self.pending:
                n = max(n, self.pending[name][0])
            gpus += n * self.cfg.pool(name).gpus_per_replica
        self.max_gpus = max(self.max_gpus, gpus)
        for name, (target, left) in list(self.pending.items()):
            if left <= 0:
                if not (name in self.never_ready and target > self.running(name)):
                    setattr(self, name, target)
                del self.pending[name]
            else:
                self.pending[name] = (target, left - 1)
        self.t += self.cfg.interval_s
        return d


def run(sim: Sim, ticks: int, load: Callable[[int], tuple[float, float]]) -> Sim:
    for i in range(ticks):
        sim.tick(*load(i))
    return sim


def test_zero_traffic_returns_both_pools_to_minimum() -> None:
    """No work for a whole demand window needs no replica; the stabilization then steps each pool down to its
    minimum, one step per interval (min 0 included)."""
    cfg = config(scale_down_stabilization_s=60.0, decode={"min_replicas": 0, "max_replicas": 4})
    sim = run(Sim(cfg, prefill=4, decode=4), 40, lambda i: (0.0, 0.0))
    assert (sim.prefill, sim.decode) == (1, 0)
    assert all(d.prefill.desired >= 1 for d in sim.history)
    assert all(abs(d.decode.desired - d.decode.current) <= 1 for d in sim.history)
    assert "no work for" in next(d.decode.reason for d in sim.history if d.decode.action == "scale_down")
    # Work on one tick of the window restarts its count: no step down within a demand window of it.
    busy = run(Sim(cfg, prefill=1, decode=2), 12, lambda i: (0.0, 0.5 if i == 11 else 0.0))
    assert busy.state.decode.idle_since is None


def test_oscillation_bait_two_to_one() -> None:
    """Two decode engines at 0.55 each: 1.1 engines of demand, more than one engine carries: never down."""
    sim = run(Sim(config(), prefill=1, decode=2), 40, lambda i: (0.05, 1.1))
    assert sim.decode == 2
    assert all(d.decode.action == "hold" for d in sim.history), [d.decode.reason for d in sim.history]
    assert sim.history[-1].decode.code == "load_steady"


def test_a_scale_down_waits_until_the_stabilization_window_holds_no_higher_need() -> None:
    cfg = config(scale_down_stabilization_s=20.0, demand_window_s=20.0)
    # Demand dips for 3 ticks (15 s) between two peaks: no scale-down.
    peak, dip = (0.05, 1.4), (0.05, 0.4)
    load = [peak] * 2 + [dip] * 3 + [peak] * 2 + [dip] * 3 + [peak]
    sim = run(Sim(cfg, prefill=1, decode=2, state=WATCHING), len(load), lambda i: load[i])
    assert sim.decode == 2 and all(d.decode.action == "hold" for d in sim.history)
    long_dip = [peak] * 2 + [dip] * 12
    sim = run(Sim(cfg, prefill=1, decode=2, state=WATCHING), len(long_dip), lambda i: long_dip[i])
    assert sim.decode == 1
    down = next(i for i, d in enumerate(sim.history) if d.decode.action == "scale_down")
    assert down * 5.0 >= 20.0 + 5.0, [d.decode.reason for d in sim.history]


def test_the_first_look_holds_the_fleet_it_found_for_the_stabilization() -> None:
    """A planner that starts (or restarts) on a fleet larger than today's load needs does not trim it before
    one stabilization window has passed (the HPA seeds its recommendations with the current count): it knows
    nothing of the load before it. Measured: the fleet scale's prefill no longer trims 12 -> 9 before its
    peak only to ask for 41 (docs/planner.md)."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    sim = run(Sim(cfg, prefill=1, decode=4), 12, lambda i: (0.05, 0.4))  # 55 s of light load on 4 replicas
    assert sim.decode == 4 and all(d.decode.action == "hold" for d in sim.history)
    why = sim.history[-1].decode.reason
    assert "the 4 replicas found at the planner's first look 55s ago (stabilization)" in why, why
    assert (sim.state.decode.first_look_at, sim.state.prefill.first_look_at) == (0.0, 0.0)
    # Past the window (300 s from the first look), the usual scale-down follows, one step at a time.
    sim.t = 305.0
    run(sim, 4, lambda i: (0.05, 0.4))
    assert sim.decode in (2, 3), sim.history[-1].decode.reason
    assert all(d.decode.current - d.decode.desired <= 1 for d in sim.history)
    # Without a stabilization window there is nothing to hold: the first look changes nothing. (An idle pool
    # is not held either: test_zero_traffic_returns_both_pools_to_minimum starts from a fresh state.)
    unheld = config(scale_down_stabilization_s=0.0)
    sim = run(Sim(unheld, prefill=1, decode=4), 1, lambda i: (0.05, 0.4))
    assert sim.history[0].decode.action == "scale_down", sim.history[0].decode.reason


def test_replica_that_never_becomes_ready_is_abandoned() -> None:
    cfg = config(action_timeout_s=30.0)
    sim = Sim(cfg, prefill=1, decode=1, never_ready={"decode"})
    first = sim.tick(0.05, 1.5)
    assert first.decode.action == "scale_up"
    later = [sim.tick(0.05, 1.5).decode for _ in range(10)]
    assert later[0].reason.startswith("waiting for action 1->2")
    gave_up = next(i for i, d in enumerate(later) if "abandoning it and asking for 1" in d.reason)
    assert gave_up == 5  # started at t=0, 30 s timeout, 5 s per interval: gives up at t=30
    # It is not stuck: once the revert is acknowledged, it tries again.
    assert any(d.action == "scale_up" for d in later[gave_up + 1 : gave_up + 4])
    assert sim.decode == 1


@pytest.mark.parametrize("silent_drain", [False, True])
def test_budget_limited_rebalance_never_exceeds_budget(silent_drain: bool) -> None:
    cfg = config(
        gpu_budget=4,
        prefill={"min_replicas": 1, "max_replicas": 4},
        decode={"min_replicas": 1, "max_replicas": 4},
    )
    sim = Sim(cfg, prefill=2, decode=2, delay=2, silent_drain=silent_drain)
    d = sim.tick(0.1, 3.0)  # prefill nearly idle, decode overloaded
    assert d.decode.action == "hold" and "rebalancing from prefill" in d.decode.reason
    assert d.prefill.action == "scale_down" and d.prefill.reason.startswith("rebalance")
    run(sim, 12, lambda i: (0.1, 3.0))
    assert (sim.prefill, sim.decode) == (1, 3)
    assert sim.max_gpus <= 4


def test_budget_blocks_when_other_pool_cannot_give() -> None:
    cfg = config(gpu_budget=4)
    sim = run(Sim(cfg, prefill=2, decode=2), 6, lambda i: (1.5, 3.0))
    assert (sim.prefill, sim.decode) == (2, 2) and sim.max_gpus <= 4
    assert (
        "cannot give a replica" in sim.history[-1].decode.reason
        or "cannot give" in sim.history[-1].prefill.reason
    )


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.tuples(st.floats(0, 6), st.floats(0, 6)), min_size=5, max_size=40),
    budget=st.integers(2, 8),
    p0=st.integers(1, 4),
    d0=st.integers(1, 4),
    delay=st.integers(0, 3),
    silent=st.booleans(),
)
def test_random_traffic_respects_bounds_and_budget(
    loads: list[tuple[float, float]], budget: int, p0: int, d0: int, delay: int, silent: bool
) -> None:
    if p0 + d0 > budget:
        budget = p0 + d0
    cfg = config(gpu_budget=budget)
    sim = run(
        Sim(cfg, prefill=p0, decode=d0, delay=delay, silent_drain=silent), len(loads), lambda i: loads[i]
    )
    assert sim.max_gpus <= budget
    for d in sim.history:
        for pd in (d.prefill, d.decode):
            assert 1 <= pd.desired <= 4
            # Proportional sizing may add several replicas at once; a scale-down is one step.
            assert pd.current - pd.desired <= cfg.scale_down_step


@settings(max_examples=40, deadline=None)
@given(
    loads=st.lists(st.tuples(st.floats(0, 6), st.floats(0, 6)), min_size=5, max_size=30),
    cap=st.integers(1, 3),
    delay=st.integers(0, 3),
)
def test_random_traffic_respects_the_per_action_cap(
    loads: list[tuple[float, float]], cap: int, delay: int
) -> None:
    cfg = config(max_scale_up_step=cap, prefill={"max_replicas": 8}, decode={"max_replicas": 8})
    sim = run(Sim(cfg, prefill=1, decode=1, delay=delay), len(loads), lambda i: loads[i])
    asked: dict[str, int] = {}
    for d in sim.history:
        for pd in (d.prefill, d.decode):
            assert 1 <= pd.desired <= 8
            if pd.action == "scale_up":
                # On top of what runs, or of a scale-up still starting: at most ``cap`` more.
                base = max(pd.current, asked.get(pd.pool, 0))
                assert pd.desired - base <= cap, pd.reason
                asked[pd.pool] = pd.desired
            elif pd.action == "scale_down":
                asked[pd.pool] = pd.desired


# --------------------------------------------------------------------------------------------------
# Proportional, startup-aware sizing (docs/planner.md, "Sizing").


def test_one_decision_adds_what_the_load_needs() -> None:
    """3.4 engines of decode demand on one engine: one action asks for ceil(3.4 / 0.85) = 4 replicas."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    decode = [rec("d0", s_decode=8, s_decode_kv=int(3.4 * KV))]
    d, _ = decide(obs(0.0, [heartbeat("p0")], decode), PolicyState(), cfg)
    assert (d.decode.action, d.decode.desired) == ("scale_up", 4), d.decode.reason
    assert d.decode.sizing is not None and d.decode.sizing.needed == 4
    assert d.decode.signals.demand == pytest.approx(3.4)
    # ... bounded by max_replicas and by the per-action cap.
    d, _ = decide(obs(0.0, [heartbeat("p0")], decode), PolicyState(), config(max_scale_up_step=2))
    assert d.decode.desired == 3


def test_starting_replicas_are_capacity_to_come() -> None:
    """Asked for 4; three still starting: the same load asks for nothing more, a bigger one does."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    decode = [rec("d0", s_decode=8, s_decode_kv=int(3.4 * KV))]
    _, state = decide(obs(0.0, [heartbeat("p0")], decode), PolicyState(), cfg)
    # The connector runs 4 (3 starting, not publishing yet): no mismatch hold, no second ask.
    o = obs(5.0, [heartbeat("p0")], decode, decode_replicas=4)
    o = type(o)(o.now, o.prefill, type(o.decode)(**{**_fields(o.decode), "starting": 3}), o.settled)
    d, state = decide(o, state, cfg)
    assert d.decode.action == "hold" and d.decode.desired == 4, d.decode.reason
    assert "waiting for action 1->4" in d.decode.reason and "silent" not in d.decode.reason
    # Load doubles while they start: asks on top of them, without waiting.
    bigger = [rec("d0", s_decode=8, s_decode_kv=int(6.0 * KV))]
    o = obs(10.0, [heartbeat("p0")], bigger, decode_replicas=4)
    o = type(o)(o.now, o.prefill, type(o.decode)(**{**_fields(o.decode), "starting": 3}), o.settled)
    d, state = decide(o, state, cfg)
    assert d.decode.action == "scale_up" and d.decode.desired >= 6, d.decode.reason


def _fields(p: object) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(p, f.name) for f in fields(p)}  # type: ignore[arg-type]  # any dataclass instance


def test_startup_time_is_measured_from_action_to_first_record() -> None:
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 8}, expected_startup_s=60.0, forecast={"enabled": True}
    )
    decode = [rec("d0", s_decode=8, s_decode_kv=int(1.5 * KV))]
    d, state = decide(obs(0.0, [heartbeat("p0")], decode), PolicyState(), cfg)
    assert state.decode.startup_probe == (0.0, 1)
    assert (d.decode.signals.lead_s, d.decode.signals.startup_measured) == (60.0, False)
    both = [*decode, rec("d1", s_decode=1, s_decode_kv=100)]
    d, state = decide(obs(35.0, [heartbeat("p0")], both, decode_replicas=2), state, cfg)
    assert state.decode.startup_s == 35.0 and state.decode.startup_probe is None
    # The next sizing looks 35 s ahead, not 60; and the decision says it was measured.
    assert (d.decode.signals.lead_s, d.decode.signals.startup_measured) == (35.0, True)
    assert (d.prefill.signals.lead_s, d.prefill.signals.startup_measured) == (60.0, False)


def test_startup_is_timed_for_the_ask_not_for_a_replica_already_starting() -> None:
    """A second ask while the first one's replica still starts: that replica landing 10 s later is not
    this ask's startup (on the slow wave it read 28 s on a 60 s cold start, and sized too little ahead)."""
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 8}, expected_startup_s=60.0, forecast={"enabled": True}
    )
    hot = [rec("d0", s_decode=8, s_decode_kv=int(1.5 * KV))]
    _, state = decide(obs(0.0, [heartbeat("p0")], hot), PolicyState(), cfg)
    assert state.decode.in_flight is not None and state.decode.in_flight.target == 2
    state = type(state)(state.prefill, type(state.decode)(**{**_fields(state.decode), "startup_probe": None}))
    # 50 s later, load has grown: a new ask on top of the replica still starting.
    hotter = [rec("d0", s_decode=8, s_decode_kv=int(3.0 * KV))]
    d, state = decide(obs(50.0, [heartbeat("p0")], hotter, decode_replicas=2), state, cfg)
    assert d.decode.action == "scale_up", d.decode.reason
    assert state.decode.startup_probe == (50.0, 2)  # counted from running + starting, not from 1
    # The first ask's replica lands at 60 s: not this ask's.
    two = [*hotter, rec("d1", s_decode=1, s_decode_kv=100)]
    _, state = decide(obs(60.0, [heartbeat("p0")], two, decode_replicas=d.decode.desired), state, cfg)
    assert state.decode.startup_s is None and state.decode.startup_probe == (50.0, 2)
    # This ask's first replica lands at 110 s: 60 s.
    three = [*two, rec("d2", s_decode=1, s_decode_kv=100)]
    _, state = decide(obs(110.0, [heartbeat("p0")], three, decode_replicas=d.decode.desired), state, cfg)
    assert state.decode.startup_s == 60.0


@pytest.mark.parametrize("enabled", [True, False])
def test_the_forecast_sizes_a_sustained_rise_ahead_only_when_enabled(enabled: bool) -> None:
    """Demand rising steadily on 3 engines (0.1 -> 0.5 each over 25 s): the forecast sizes today's demand plus
    its slope over a startup (60 s) at the target; without it the pool is sized for its window only."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8}, forecast={"enabled": enabled})
    state = PolicyState()
    for i, t in enumerate(range(0, 30, 5)):
        per = 0.1 + 0.08 * i
        decode = [rec(f"d{k}", s_decode=1, s_decode_kv=int(per * KV)) for k in range(3)]
        d, state = decide(obs(float(t), [heartbeat("p0")], decode), state, cfg)
    if enabled:
        assert (d.decode.action, d.decode.code) == ("scale_up", "load_up"), d.decode.reason
        assert "forecast growth" in d.decode.reason and (d.decode.signals.slope or 0.0) > 0
    else:
        assert d.decode.action == "hold" and d.decode.signals.slope is None, d.decode.reason
        assert not state.decode.trend


def test_deleted_settings_are_refused_and_the_forecasts_are_checked() -> None:
    for key in ("decode_trend", "late_landing_s", "variance_sizing", "scale_down_window_s", "idle_window_s"):
        with pytest.raises(ConfigError, match=f"^{key}: unknown option"):
            config(**{key: 1})
    with pytest.raises(ConfigError, match=r"forecast\.min_r2"):
        config(forecast={"min_r2": 1.5})
    with pytest.raises(ConfigError, match=r"forecast\.window_s"):
        config(forecast={"window_s": -1.0})
    for key in ("noise_z", "throughput_cap", "projection_cap"):
        with pytest.raises(ConfigError, match=rf"forecast\.{key}"):
            config(forecast={key: -1.0})
        assert getattr(config(forecast={key: 0}).forecast, key) == 0


def test_scale_down_stabilization_remembers_what_was_needed() -> None:
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 8},
        demand_window_s=20.0,
        scale_down_stabilization_s=60.0,
    )
    sim = Sim(cfg, prefill=1, decode=1)
    run(sim, 2, lambda i: (0.05, 3.0))  # needs 4
    assert sim.decode == 4
    run(sim, 8, lambda i: (0.05, 0.4))  # 40 s of little load: still within 60 s of the need
    assert sim.decode == 4, [d.decode.reason for d in sim.history[-3:]]
    assert "stabilization" in sim.history[-1].decode.reason
    run(sim, 10, lambda i: (0.05, 0.4))
    assert sim.decode < 4


def test_aggregated_workers_count_their_queued_prompts() -> None:
    """Upstream's case: three aggregated engines with 20 queued prompts each must not be scaled down."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    agg = [
        rec(f"a{i}", s_decode=2, s_decode_kv=400, q_prefill=20, q_prefill_tokens=20 * 1500) for i in range(3)
    ]
    d, _ = decide(obs(0.0, [], agg, prefill_replicas=0), PolicyState(), config_with_no_prefill(cfg))
    assert d.decode.action == "scale_up", d.decode.reason


def config_with_no_prefill(cfg: PlannerConfig) -> PlannerConfig:
    from dataclasses import replace as dc_replace

    from dynamo.planner.config import PoolConfig

    return dc_replace(cfg, prefill=PoolConfig(min_replicas=0, max_replicas=0))


def test_an_on_time_tick_after_a_late_one_may_act() -> None:
    """The interval guard: a tick 4.8 s after a late one (interval 5 s) is not held."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8}, max_scale_up_step=1)
    high = [rec("d0", s_decode=8, s_decode_kv=int(2.0 * KV))]
    _, state = decide(obs(10.2, [heartbeat("p0")], high), PolicyState(), cfg)
    two = [rec("d0", s_decode=8, s_decode_kv=int(2.0 * KV)), rec("d1", s_decode=8, s_decode_kv=int(2.0 * KV))]
    d, _ = decide(obs(15.0, [heartbeat("p0")], two, decode_replicas=2), state, cfg)
    assert d.decode.action == "scale_up", d.decode.reason
    assert "last step" not in d.decode.reason
    # Called again within half an interval: held.
    d2, _ = decide(obs(12.0, [heartbeat("p0")], two, decode_replicas=2), state, cfg)
    assert d2.decode.action == "hold" and "last step" in d2.decode.reason


def test_a_publishing_replica_is_never_counted_as_starting() -> None:
    """A connector that still calls a publishing worker "starting" (its state file lags) does not hide
    load."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    decode = [rec("d0", s_decode=8, s_decode_kv=int(1.15 * KV))]
    o = obs(0.0, [heartbeat("p0")], decode)
    o = type(o)(o.now, o.prefill, type(o.decode)(**{**_fields(o.decode), "starting": 1}), o.settled)
    d, _ = decide(o, PolicyState(), cfg)
    assert d.decode.action == "scale_up" and "over 1" in d.decode.reason, d.decode.reason


def test_a_consistent_rise_of_a_tiny_load_does_not_scale_ahead() -> None:
    """The demo's warm-up: a few requests rising steadily (0.02 -> 0.12 of one engine) must not read as
    a ramp worth a replica; the same rise on a real share of the pool does (docs/planner.md, Forecast)."""
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 8}, expected_startup_s=60.0, forecast={"enabled": True}
    )

    def rise(start: float, step: float) -> list[Decision]:
        state, out = PolicyState(), []
        for t in range(6):  # one sample a second, as the demo's warm-up rose
            decode = [rec("d0", s_decode=1, s_decode_kv=int((start + step * t) * KV))]
            d, state = decide(obs(float(t), [heartbeat("p0")], decode), state, cfg)
            out.append(d)
        return out

    tiny = rise(0.02, 0.02)
    assert all(d.decode.action == "hold" for d in tiny), [d.decode.reason for d in tiny]
    last = tiny[-1].decode
    assert last.sizing is not None and last.sizing.needed == 1 and (last.signals.slope or 0.0) > 0
    real = rise(0.3, 0.08)
    assert any(d.decode.action == "scale_up" for d in real), [d.decode.reason for d in real]


def _decode_light_while_prefill_grows() -> Sim:
    """Decode wants down (0.4 engines on 4 replicas) while prompts flood prefill, whose scale-up takes 6
    ticks to land, and decode's light load stays as it was."""
    cfg = config(scale_down_stabilization_s=0.0)
    sim = Sim(cfg, prefill=1, decode=4, delay=6, state=WATCHING)
    return run(sim, 16, lambda i: (3.0, 0.4))  # prefill steps up, then its replicas start


def test_decode_does_not_scale_down_while_prefill_scales_up() -> None:
    """The fleet scale at 60 s cold start released a decode replica 5 s into its step to 200 req/s and asked
    for 28 more 70 s later: in disaggregated serving, prefill's new prompts are decode's next work."""
    sim = _decode_light_while_prefill_grows()
    assert sim.history[0].prefill.action == "scale_up", sim.history[0].prefill.reason
    # The ticks prefill asks for replicas or waits for them to start.
    rising = [d for d in sim.history if d.prefill.desired > d.prefill.current]
    assert len(rising) >= 6
    assert all(d.decode.action == "hold" for d in rising), [d.decode.reason for d in rising]
    held = [d for d in rising if d.decode.signals.prefill_rising_to is not None]
    assert held and all(d.decode.code == "decode_follows_prefill" for d in held)
    for d in held:  # the target prefill is asked for or starting, that tick
        assert d.decode.signals.prefill_rising_to == d.prefill.desired > 1, (d.prefill, d.decode.reason)
        assert f"prefill is scaling up to {d.prefill.desired}" in d.decode.reason, d.decode.reason
    # Once prefill has landed (and asks for no more), decode's usual scale-down follows.
    landed = sim.history.index(rising[-1]) + 1
    assert sim.prefill >= 3
    assert any(d.decode.action == "scale_down" for d in sim.history[landed:]), [
        d.decode.reason for d in sim.history
    ]


def test_decode_above_its_maximum_steps_down_while_prefill_scales_up() -> None:
    """Bounds are not the sizing's: a decode pool over max_replicas steps down whatever prefill does."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 2})
    sim = run(Sim(cfg, prefill=1, decode=4, delay=6), 3, lambda i: (3.0, 0.4))
    assert sim.history[0].prefill.action == "scale_up"
    assert sim.history[0].decode.action == "scale_down"


def test_a_backlog_on_one_engine_counts_up_to_what_the_engine_holds() -> None:
    """The idle gap at 60 s cold start: the first engine's backlog (load 3.5) stays on it under round-robin
    routing. A queue behind full slots says the pool is short, not by how much: it counts up to what the
    engine holds (1.0 + 1.0), and the five light engines add 0.5: 2.5 engines, which 6 replicas carry."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    backlog = rec("d0", s_decode=8, s_decode_kv=KV, q_decode=20, q_decode_kv=int(2.5 * KV))
    light = [rec(f"d{i}", s_decode=1, s_decode_kv=int(0.1 * KV)) for i in range(1, 6)]
    d, _ = decide(obs(0.0, [rec("p0")], [backlog, *light]), PolicyState(), cfg)
    assert d.decode.action == "hold", d.decode.reason
    assert d.decode.signals.demand == pytest.approx(2.5) and d.decode.signals.needed == 3


def test_an_aggregated_deployment_asking_for_a_prefill_replica_does_not_hold_decode() -> None:
    """Aggregated workers with prefill's minimum left at 1: the bounds ask for a prefill replica that never
    comes (no prefill workers publish), and decode's scale-downs must not wait for it."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 8})
    light = [rec(f"a{i}", s_decode=1, s_decode_kv=int(0.05 * KV)) for i in range(4)]
    d, _ = decide(obs(0.0, [], light, prefill_replicas=0), WATCHING, cfg)
    assert d.prefill.action == "scale_up", d.prefill.reason  # below min_replicas 1
    assert d.decode.action == "scale_down", d.decode.reason
    assert d.decode.signals.prefill_rising_to is None


# --------------------------------------------------------------------------------------------------
# Arrivals (docs/planner.md, "Arrivals"): a prefill pool busy without a queue is not consolidated.

# Pass time 10 ms + 20 us per token: in full passes of 512 tokens (CAP) a token costs 39.5 us, so one
# engine carries 25,300 prompt tokens/s.
PASS_FIT = LinearFit((0.01, 2e-5), 50)
TOKEN_S = 2e-5 + 0.01 / 512


def _prefill_without_a_queue(
    cfg: PlannerConfig, arrivals: Arrivals | None, ticks: int = 4
) -> tuple[Decision, list[Decision]]:
    """Two prefill engines with passes but no queue (load 0), one decode engine, ``ticks`` decisions."""
    prefill = [rec(f"p{i}", s_prefill=1, s_prefill_tokens=500) for i in range(2)]
    decode = [rec("d0", s_decode=4, s_decode_kv=int(0.7 * KV))]
    state, history = WATCHING, []
    for i in range(ticks):
        o = obs(5.0 * i, prefill, decode)
        o = replace(o, prefill=replace(o.prefill, latency=PASS_FIT), arrivals=arrivals)
        d, state = decide(o, state, cfg)
        history.append(d)
    return history[-1], history


@pytest.mark.parametrize(
    ("tokens_s", "action"),
    [
        (1.5 / TOKEN_S, "hold"),  # 1.5 engines' worth: both engines stay
        (0.5 / TOKEN_S, "scale_down"),  # half an engine's worth: one carries it
    ],
)
def test_a_prefill_pool_busy_without_a_queue_is_sized_by_its_arrivals(tokens_s: float, action: str) -> None:
    """Steady traffic that keeps two prefill engines busy leaves no queue: its load reads 0. Measured on a
    steady 8 req/s of 8,000-token prompts: trimmed to one engine, then asked back, every 300 s; with the
    frontend's arrivals the pool is sized for the prompt work they bring."""
    cfg = config()
    last, _ = _prefill_without_a_queue(cfg, Arrivals(tokens_s / 1000, 1000.0, 5.0), ticks=1)
    assert last.prefill.signals.arrival_engines == pytest.approx(tokens_s * TOKEN_S, abs=1e-3)
    assert last.prefill.action == action, last.prefill.reason
    # Without a source (or with it switched off): no queue reads as no demand, and one engine is kept.
    for cfg_, arrivals in (
        (cfg, None),
        (config(use_arrivals=False), Arrivals(tokens_s / 1000, 1000.0, 5.0)),
    ):
        last, _ = _prefill_without_a_queue(cfg_, arrivals, ticks=1)
        assert last.prefill.action == "scale_down", last.prefill.reason
        assert last.prefill.signals.arrival_engines is None


def test_arrival_engines_fall_back_to_the_saturated_rate_and_need_a_model_or_a_rate() -> None:
    """No pass-time fit: a token costs one over the rate measured on saturated engines; neither: unknown."""
    prefill = pool("prefill", [rec("p0", s_prefill=1, s_prefill_tokens=500)])
    arrivals = Arrivals(10.0, 1000.0, 5.0)
    view = PoolView(prefill, PoolState(), config(), 1, 60.0, arrivals=arrivals)
    assert arrival_engines(view, 20_000.0) == pytest.approx(0.5)
    assert arrival_engines(view, None) is None
    few = replace(prefill, latency=LinearFit((0.01, 2e-5), 3))  # under sla.min_samples: not trusted
    assert arrival_engines(replace(view, pool=few), None) is None
    assert arrival_engines(replace(view, pool=replace(prefill, latency=PASS_FIT)), None) == pytest.approx(
        10_000 * TOKEN_S
    )
    assert arrival_engines(replace(view, arrivals=None), 20_000.0) is None


def _decode_rise(per_engine: list[int], **forecast: Any) -> list[Decision]:
    """Two decode engines whose running requests go through ``per_engine`` (one look per 5 s), with the
    frontend's 4 req/s (requests that live about 13-25 s): the decisions."""
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 8},
        forecast={"enabled": True, "window_s": 40.0, **forecast},
    )
    state, out = PolicyState(), []
    for i, n in enumerate(per_engine):
        decode = [rec(f"d{k}", s_decode=n, s_decode_kv=n * 10) for k in range(2)]
        o = replace(obs(5.0 * i, [heartbeat("p0")], decode), arrivals=Arrivals(4.0, 1000.0, 5.0))
        d, state = decide(o, state, cfg)
        out.append(d)
    return out


def _scaled_up(decisions: list[Decision]) -> bool:
    return any(d.decode.action == "scale_up" for d in decisions)


def test_a_rise_within_the_requests_wander_does_not_scale_ahead() -> None:
    """52 -> 74 requests in flight over 35 s, in a straight line: a 3-sigma wander of 74 requests living
    18 s is 0.57 engines of slots, the rise 0.34; the trend alone (no gate) asks for a third engine."""
    wander = [26, 28, 29, 31, 32, 34, 35, 37]
    held = _decode_rise(wander)
    assert not _scaled_up(held)
    sig = held[-1].decode.signals
    assert sig.trend_rise == pytest.approx(22 / 64, abs=0.02) and sig.trend_noise == pytest.approx(
        0.57, abs=0.01
    )
    assert _scaled_up(_decode_rise(wander, noise_z=0.0))
    # Twice as steep (52 -> 100): beyond the wander, scales ahead with the gate on.
    growth = [26, 29, 33, 36, 40, 43, 47, 50]
    assert _scaled_up(_decode_rise(growth))
    assert not _scaled_up(_decode_rise(growth, noise_z=100.0))  # the trend's ask, through the gate


def _saturated_engine_filling(rates: list[float], **forecast: Any) -> Decision:
    """One decode engine, slots full from the first look, its queue growing by 14 requests per 5 s
    (2.8 req/s) while the frontend admits ``rates`` (one look per 5 s): the last decision."""
    cfg = config(
        decode={"min_replicas": 1, "max_replicas": 16},
        forecast={"enabled": True, "window_s": 40.0, **forecast},
    )
    state = PolicyState()
    for i, rate in enumerate(rates):
        decode = [rec("d0", s_decode=64, s_decode_kv=KV // 2, q_decode=14 * i, q_decode_kv=100 * i)]
        o = replace(obs(5.0 * i, [heartbeat("p0")], decode), arrivals=Arrivals(rate, 1000.0, 5.0))
        d, state = decide(o, state, cfg)
    return d


def test_a_saturated_pool_is_projected_no_further_than_its_arrivals_need() -> None:
    """6 req/s arrive, the queue grows 2.8 req/s: the engine completes 3.2 req/s, so the arrivals keep
    6 / 3.2 = 1.9 engines busy. The trend of the growing queue (demand 2.0 engines at the sixth look)
    projects 4.4 engines one startup ahead (6 replicas at the 0.85 target); the bound, 1.5 x 1.9 = 2.8
    engines, asks for 4."""
    d = _saturated_engine_filling([6.0] * 6)
    s = d.decode.sizing
    assert s is not None and s.demand == pytest.approx(2.0)
    assert d.decode.signals.completed_per_s == pytest.approx(3.2)
    assert d.decode.signals.throughput_bound == pytest.approx(1.5 * 6 / 3.2, abs=1e-3)
    assert s.projected == pytest.approx(1.5 * 6 / 3.2, abs=1e-3) and s.needed == 4
    off = _saturated_engine_filling([6.0] * 6, throughput_cap=0.0).decode
    assert off.sizing is not None and off.sizing.needed is not None and off.sizing.needed >= 6
    assert off.signals.throughput_bound is None
    # Without arrivals the bound cannot be told: the trend sizes alone.
    cfg = config(decode={"min_replicas": 1, "max_replicas": 16}, forecast={"enabled": True, "window_s": 40.0})
    state = PolicyState()
    for i in range(6):
        decode = [rec("d0", s_decode=64, s_decode_kv=KV // 2, q_decode=14 * i, q_decode_kv=100 * i)]
        blind, state = decide(obs(5.0 * i, [heartbeat("p0")], decode), state, cfg)
    assert blind.decode.sizing is not None and blind.decode.sizing.needed == off.sizing.needed


def test_the_throughput_bound_follows_a_consistent_rise_in_arrivals() -> None:
    """Arrivals 6 -> 8 req/s in a straight line: the bound is sized for the arrivals one startup (60 s)
    ahead, 8 + 0.1 x 60 = 14 req/s, over the 8 - 2.8 = 5.2 req/s the engine completes."""
    d = _saturated_engine_filling([6.0, 6.5, 7.0, 7.5, 8.0])
    assert d.decode.signals.completed_per_s == pytest.approx(5.2)
    assert d.decode.signals.throughput_bound == pytest.approx(1.5 * 14 / 5.2, abs=1e-3)


def test_an_unsaturated_pool_has_no_throughput_bound() -> None:
    """Slots 60 of 64 with a growing KV: nothing queues behind a full engine, so its completions are not
    what it can do; the trend sizes alone."""
    cfg = config(decode={"min_replicas": 1, "max_replicas": 16}, forecast={"enabled": True, "window_s": 40.0})
    state = PolicyState()
    for i in range(6):
        decode = [rec("d0", s_decode=60, s_decode_kv=int((0.3 + 0.1 * i) * KV))]
        o = replace(obs(5.0 * i, [heartbeat("p0")], decode), arrivals=Arrivals(6.0, 1000.0, 5.0))
        d, state = decide(o, state, cfg)
    assert d.decode.signals.throughput_bound is None and d.decode.signals.completed_per_s is None


RULE_CODES = {
    "in_flight_abandoned",
    "in_flight_down_wait",
    "bounds_min",
    "bounds_max",
    "mismatch_grace",
    "idle_silent_busy",
    "idle_at_min",
    "idle_scale_up_starting",
    "load_up_at_max",
    "load_up_carried",
    "load_up",
    "load_up_starting",
    "load_stabilized",
    "load_silent_busy",
    "load_at_min",
    "load_down",
    "load_steady",
    "sizing_hold",
    "interval_guard",
    "decode_follows_prefill",
    "gpu_budget_cut",
    "gpu_budget_wait",
    "gpu_budget_rebalance",
}


def _codes(sim: Sim, pool: str) -> list[str]:
    return [d.pool(pool).code for d in sim.history]  # type: ignore[arg-type]


def test_a_noisy_decode_load_is_sized_for_its_spread_and_never_shrunk_into_the_next_spike() -> None:
    """Demand swinging 0.3 <-> 1.7 engines around a mean of 1: the pool keeps the 2 replicas that carry
    its highest samples (mean + 2 spreads, 2.4, is above them) for the whole run, a spike's worth of
    headroom that a consolidation check on one tick's load does not keep."""
    swing = lambda i: (0.05, 1.7 if i % 2 else 0.3)  # noqa: E731
    sim = run(Sim(config(), prefill=1, decode=2), 120, swing)
    assert sim.decode == 2 and all(d.decode.action == "hold" for d in sim.history), _codes(sim, "decode")
    last = sim.history[-1].decode
    assert last.code == "load_steady", last.reason
    assert last.signals.demand_mean == pytest.approx(1.0, abs=0.1)
    assert last.signals.demand_spread == pytest.approx(0.7, abs=0.1)


def test_the_headroom_follows_the_demands_spread() -> None:
    """The same mean demand: steady, one replica carries it; swinging, two are sized."""
    steady = run(Sim(config(), prefill=1, decode=1), 20, lambda i: (0.05, 0.7))
    assert steady.decode == 1 and steady.history[-1].decode.code == "load_steady"
    swinging = run(Sim(config(), prefill=1, decode=1), 20, lambda i: (0.05, 1.3 if i % 2 else 0.1))
    assert swinging.decode == 2
    assert "load_up" in _codes(swinging, "decode")


def test_a_scale_down_goes_no_lower_than_the_windows_highest_recommendation() -> None:
    """The HPA's stabilization over every tick's recommendation: 3 replicas needed, then a light load holds
    them for the window, then the pool steps down."""
    cfg = config(scale_down_stabilization_s=120.0)
    sim = run(Sim(cfg, prefill=1, decode=1, state=WATCHING), 3, lambda i: (0.05, 2.5))
    assert sim.decode == 3
    run(sim, 16, lambda i: (0.05, 0.3))  # 80 s of light load: past the demand window, within 120 s
    assert sim.decode == 3 and sim.history[-1].decode.code == "load_stabilized"
    run(sim, 24, lambda i: (0.05, 0.3))
    assert sim.decode < 3 and "load_down" in _codes(sim, "decode")


def test_a_level_within_the_tolerance_of_capacity_neither_grows_nor_shrinks_the_pool() -> None:
    """The band around capacity (``robust.TOLERANCE``, the HPA's 10%): spikes to 1.08 engines over a mean
    of 0.82 put the level within 10% above one replica's capacity, and one replica holds. On two replicas,
    a level of 0.95 engines (mean 0.78) would load a lone replica within 10% of capacity: the pool keeps
    two; at 0.85 it steps down."""
    spikes = lambda i: (0.05, 1.08 if i % 4 == 3 else 0.7)  # noqa: E731
    one = run(Sim(config(), prefill=1, decode=1), 60, spikes)
    assert one.decode == 1 and set(_codes(one, "decode")) == {"load_steady"}, _codes(one, "decode")
    near = run(Sim(config(), prefill=1, decode=2), 120, lambda i: (0.05, 0.95 if i % 2 else 0.6))
    assert near.decode == 2 and "load_down" not in _codes(near, "decode")
    assert near.history[-1].decode.signals.needed == 2
    clear = run(Sim(config(), prefill=1, decode=2), 120, lambda i: (0.05, 0.85 if i % 2 else 0.5))
    assert clear.decode == 1 and "load_down" in _codes(clear, "decode")
    # Beyond the band the pool grows to carry the whole level (3.2 engines: 4 replicas, not the 3 that would
    # carry it within the tolerance), as the HPA sizes a ratio outside its tolerance in full.
    beyond = run(Sim(config(), prefill=1, decode=1), 30, lambda i: (0.05, 3.2 if i % 3 == 2 else 1.0))
    assert beyond.decode == 4, [d.decode.reason for d in beyond.history if d.decode.action != "hold"]


def test_bursty_traffic_between_bursts_is_not_idle() -> None:
    """Twenty-five seconds of nothing, then a burst, again and again: the pool does not step down between
    bursts (the legacy idle rule did, then scaled back up at the next burst)."""
    bursts = lambda i: (0.05, 1.8 if i % 6 == 5 else 0.0)  # noqa: E731
    sim = run(Sim(config(), prefill=1, decode=2), 143, bursts)
    assert sim.decode == 2 and all(d.decode.action == "hold" for d in sim.history), _codes(sim, "decode")
    assert sim.state.decode.idle_since is not None  # idle between bursts, never for a whole demand window


def test_a_step_up_in_demand_is_answered_at_once() -> None:
    sim = run(Sim(config(), prefill=1, decode=1, state=WATCHING), 12, lambda i: (0.05, 0.5))
    d = sim.tick(0.05, 3.0)
    assert d.decode.code == "load_up" and d.decode.desired >= 3, d.decode.reason


def test_every_decision_carries_the_code_of_the_rule_that_made_it() -> None:
    load = [(0.05, x) for x in (0.2, 2.5, 2.5, 0.1, 0.1, 0.0, 3.5, 0.4)] * 12
    for cfg in (config(), config(forecast={"enabled": True}), config(gpu_budget=4)):
        sim = run(Sim(cfg, prefill=1, decode=1), len(load), lambda i: load[i])
        codes = set(_codes(sim, "decode")) | set(_codes(sim, "prefill"))
        assert codes <= RULE_CODES, codes - RULE_CODES


def test_the_rule_codes_are_the_ones_the_rules_set() -> None:
    """``RULE_CODES`` is the whole vocabulary: every ``code=`` in the rules and passes, and nothing else."""
    import re
    from pathlib import Path

    import dynamo.planner.policy as policy

    lines = [ln for p in Path(policy.__file__).parent.glob("*.py") for ln in p.read_text().splitlines()]
    coded = [ln for ln in lines if re.search(r"\bcode\b\s*=|\.code\b", ln)]
    literals = {w for ln in coded for w in re.findall(r'"(\w+)"', ln)}
    assert literals - {"hold", "up", "down", "idle", "steady", "scale_up", "scale_down"} == RULE_CODES


def test_the_docs_list_every_rule_code() -> None:
    """docs/planner.md's "Rule codes" paragraph names exactly ``RULE_CODES`` (dashboards read it)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    paragraph = doc.split("**Rule codes**", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", paragraph)) - {"code"}
    assert listed == RULE_CODES, (listed - RULE_CODES, RULE_CODES - listed)


def test_upstreams_decode_scale_up_kv_rate_sizes_the_decode_pool() -> None:
    """Upstream's ``decode_scale_up_kv_rate`` maps to ``thresholds.decode_up``, the load the demand's level
    is sized for: the same demand on engines allowed 50% asks for more replicas than at 100%."""
    from dynamo.planner.upstream import translate

    def sized(rate: int) -> int:
        upstream = {
            "optimization_target": "load",
            "decode_scale_up_kv_rate": rate,
            "decode_scale_down_kv_rate": 20,
        }
        data = translate(upstream).data
        cfg = config(target=data["target"], thresholds=data["thresholds"])
        return run(Sim(cfg, prefill=1, decode=1), 12, lambda i: (0.05, 1.5)).decode

    assert (sized(100), sized(50)) == (2, 3)


def test_kv_held_for_a_dead_decode_worker_is_prefill_capacity_lost() -> None:
    """Prefill engines holding 80% of their KV for requests no decode worker reads (a dead peer, until the
    lease ends) have room for little else: the pool asks for a replica its load alone would not."""
    from dynamo.common.forward_pass_metrics import ForwardPassMetrics

    def engines(held: int) -> list[ForwardPassMetrics]:
        busy = rec("p0", s_prefill=1, s_prefill_tokens=500, q_prefill=1, q_prefill_tokens=1200)  # saturated
        idle = rec("p1")
        return [
            ForwardPassMetrics(
                worker_id=r.worker_id,
                counter_id=1,
                wall_time=r.wall_time,
                scheduled_requests=r.scheduled_requests,
                queued_requests=r.queued_requests,
                num_held_kv_requests=12 if held else 0,
                sum_held_kv_tokens=held,
                max_held_kv_age=9.0 if held else 0.0,
            )
            for r in (busy, idle)
        ]

    decode = [rec("d0", s_decode=1, s_decode_kv=100)]
    d, _ = decide(obs(0.0, engines(0), decode, prefill_replicas=2), WATCHING, config())
    assert (d.prefill.code, d.prefill.desired) == ("load_steady", 2), d.prefill.reason
    d, _ = decide(obs(0.0, engines(int(0.8 * KV)), decode, prefill_replicas=2), WATCHING, config())
    assert (d.prefill.code, d.prefill.desired) == ("load_up", 3), d.prefill.reason
    assert d.prefill.signals.held_kv_engines == 1.6
