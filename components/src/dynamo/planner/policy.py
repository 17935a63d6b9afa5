"""The scaling policy: a pure function from observations and a small state to a decision with reasons.

No I/O, no clock (``Observation.now`` is passed in), no randomness, so every rule is testable in
microseconds and replayable offline. Rules, each a small named step below:

1. An action in flight blocks its pool until the pool reaches the target and the connector says it is
   done; after ``action_timeout_s`` the planner gives up, asks for what is actually running, moves on.
2. Replicas != publishing workers (stale, not ready, left): hold for ``mismatch_grace_s``; after that,
   decide with the missing workers counted against a scale-down (the direction of change).
3. A pool with no work at all for ``idle_window_s`` steps down to its minimum.
4. Per-engine load signals (target-specific) -> up when the pool is overloaded, down only when the
   consolidated load (total over N-1 engines) still fits, and only after ``scale_down_window_s`` of
   uninterrupted wanting.
5. At most one step per pool per interval, clamped to [min, max]; a scale-up that would exceed the GPU
   budget (counting replicas still draining) first frees a replica of the other pool, if that pool's
   consolidated load fits, and waits for it to finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from .config import PlannerConfig, Thresholds
from .observations import EngineObs, Observation, PoolObs

Action = Literal["scale_up", "scale_down", "hold"]
Want = Literal["up", "down", "idle", "steady", "hold"]


@dataclass(frozen=True, slots=True)
class InFlight:
    target: int
    previous: int
    since: float


@dataclass(frozen=True, slots=True)
class PoolState:
    down_since: float | None = None
    idle_since: float | None = None
    mismatch_since: float | None = None
    last_action_at: float | None = None
    in_flight: InFlight | None = None


@dataclass(frozen=True, slots=True)
class PolicyState:
    prefill: PoolState = PoolState()
    decode: PoolState = PoolState()

    def pool(self, name: str) -> PoolState:
        return self.prefill if name == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: str
    current: int
    desired: int
    action: Action
    reason: str
    signals: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    now: float
    prefill: PoolDecision
    decode: PoolDecision

    def pool(self, name: str) -> PoolDecision:
        return self.prefill if name == "prefill" else self.decode

    @property
    def changed(self) -> bool:
        return self.prefill.desired != self.prefill.current or self.decode.desired != self.decode.current


# --------------------------------------------------------------------------------------------------
# Signals: per-engine load for each target.


@dataclass(slots=True)
class Signals:
    """A pool's load as the policy judged it. ``want`` is before windows, clamps and budget."""

    want: Want
    why: str
    max_load: float = 0.0
    consolidated: float | None = None
    data: dict[str, Any] = field(default_factory=dict)


def engine_idle(e: EngineObs) -> bool:
    r = e.record
    s, q = r.scheduled_requests, r.queued_requests
    return (
        s.num_prefill_requests == 0
        and s.num_decode_requests == 0
        and q.num_prefill_requests == 0
        and q.num_decode_requests == 0
    )


class DecodeDemand(NamedTuple):
    tokens: float  # KV tokens the engine must hold
    requests: float  # requests that need a running slot (max_num_seqs)
    transfer_tokens: int
    waiting_tokens: int  # queued decode KV waiting for a slot (ready or preempted)
    transfer_bound: bool


def decode_demand(e: EngineObs, weight: float, up: float) -> DecodeDemand:
    """Decode work that counts as demand, in KV tokens and in running slots, with the split rule.

    Without the transfer/ready split (upstream records) every queued decode request and token counts,
    as upstream does. With it: requests whose KV arrived (ready) and preempted ones wait for a decode
    slot, so they always count; requests still in transfer count too, unless the engine is
    *transfer-bound* -- nothing waits for a slot and what it holds is at or below the scale-up
    threshold in KV and in slots -- then the transfer backlog is a link problem, not missing decode
    capacity, and counts with ``transfer_bound_weight`` (default 0).
    """
    s, q = e.record.scheduled_requests, e.record.queued_requests
    if q.sum_decode_kv_transfer_tokens is None:
        return DecodeDemand(
            float(s.sum_decode_kv_tokens + q.sum_decode_kv_tokens),
            float(s.num_decode_requests + q.num_decode_requests),
            0,
            q.sum_decode_kv_tokens,
            False,
        )
    kv = e.capacity.kv_tokens or 1
    seqs = e.capacity.max_num_seqs
    transfer = q.sum_decode_kv_transfer_tokens
    transfer_reqs = q.num_decode_kv_transfer_requests or 0
    waiting = max(q.sum_decode_kv_tokens - transfer, 0)
    waiting_reqs = q.num_decode_requests - transfer_reqs
    held = s.sum_decode_kv_tokens + waiting
    held_reqs = s.num_decode_requests + max(waiting_reqs, 0)
    bound = transfer > 0 and waiting_reqs <= 0 and held / kv <= up and (not seqs or held_reqs / seqs <= up)
    if bound:
        return DecodeDemand(
            held + weight * transfer, held_reqs + weight * transfer_reqs, transfer, waiting, True
        )
    return DecodeDemand(float(held + transfer), float(held_reqs + transfer_reqs), transfer, waiting, False)


def decode_load(e: EngineObs, dd: DecodeDemand) -> float:
    """KV demand / KV capacity, or running-slot demand / ``max_num_seqs`` when known: the higher."""
    load = dd.tokens / e.capacity.kv_tokens  # type: ignore[operator]
    seqs = e.capacity.max_num_seqs
    if seqs:
        load = max(load, dd.requests / seqs)
    return load


def _threshold_signals(pool: PoolObs, cfg: PlannerConfig, th: Thresholds, note: str = "") -> Signals:
    engines = pool.engines
    n = len(engines)
    if pool.name == "prefill":
        missing = [e.worker_id for e in engines if not e.capacity.context_length]
        if missing:
            return Signals("hold", f"capacity unknown (context_length) for worker {missing[0]}")
        loads = [e.record.queued_requests.sum_prefill_tokens / e.capacity.context_length for e in engines]  # type: ignore[operator]
        up, down = th.prefill_up, th.prefill_down
        over = max(loads) >= up
        data: dict[str, Any] = {
            "queued_prefill_tokens": sum(e.record.queued_requests.sum_prefill_tokens for e in engines)
        }
    else:
        missing = [e.worker_id for e in engines if not e.capacity.kv_tokens]
        if missing:
            return Signals("hold", f"capacity unknown (kv_tokens) for worker {missing[0]}")
        up, down = th.decode_up, th.decode_down
        loads, transfer, waiting, bound, slot_max = [], 0, 0, 0, 0.0
        for e in engines:
            dd = decode_demand(e, cfg.transfer_bound_weight, up)
            loads.append(decode_load(e, dd))
            transfer += dd.transfer_tokens
            waiting += dd.waiting_tokens
            bound += dd.transfer_bound
            if e.capacity.max_num_seqs:
                slot_max = max(slot_max, dd.requests / e.capacity.max_num_seqs)
        over = max(loads) > up
        data = {
            "decode_kv_tokens": sum(e.record.scheduled_requests.sum_decode_kv_tokens for e in engines),
            "queued_decode_kv_tokens": sum(e.record.queued_requests.sum_decode_kv_tokens for e in engines),
            "decode_kv_transfer_tokens": transfer,
            "decode_kv_waiting_tokens": waiting,
            "transfer_bound_engines": bound,
            "slot_load_max": round(slot_max, 4),
        }
    mx = max(loads)
    data.update(loads=_summ(loads), up=up, down=down)
    if over:
        return Signals("up", f"{pool.name} load {mx:.2f} over {up:g}{note}", mx, None, data)
    # Removing a replica removes all its engines (dp ranks); silent replicas count as fully loaded.
    per_worker = n / max(pool.workers, 1)
    expected = max(float(n), per_worker * pool.replicas)
    silent = expected - n
    remaining = expected - per_worker
    consolidated = (sum(loads) + silent * up) / remaining if remaining > 0 else math.inf
    data["consolidated"] = round(consolidated, 4) if math.isfinite(consolidated) else None
    limit = up * cfg.consolidation_headroom
    if silent:
        note += f" ({silent:g} silent engines counted at {up:g})"
    if mx < down:
        if consolidated < limit:
            return Signals(
                "down",
                f"{pool.name} load {mx:.2f} under {down:g}; on {remaining:g} engines {consolidated:.2f} < {limit:.2f}{note}",
                mx,
                consolidated,
                data,
            )
        if remaining <= 0:
            why = f"{pool.name} load {mx:.2f} under {down:g}; a single replica, nothing to consolidate"
        else:
            why = f"{pool.name} load {mx:.2f} under {down:g} but on {remaining:g} engines it would be {consolidated:.2f} >= {limit:.2f}"
        return Signals("steady", why + note, mx, consolidated, data)
    return Signals(
        "steady", f"{pool.name} load {mx:.2f} within [{down:g}, {up:g}]{note}", mx, consolidated, data
    )


def _sla_signals(pool: PoolObs, cfg: PlannerConfig) -> Signals:
    fit = pool.latency
    if fit is None or fit.samples < cfg.sla.min_samples:
        n = 0 if fit is None else fit.samples
        return _threshold_signals(
            pool, cfg, cfg.thresholds or Thresholds(), f" (latency model not ready: {n} samples; thresholds)"
        )
    engines = pool.engines
    n = len(engines)
    head = cfg.sla.headroom
    if pool.name == "prefill":
        target = cfg.sla.ttft_ms / 1000.0

        a, b = fit.coef

        def ttft(q: float, chunk: int | None) -> float:
            """Time to compute ``q`` queued tokens in passes of at most ``chunk`` tokens."""
            c = chunk or max(q, 1.0)
            passes = max(1.0, math.ceil(q / c))
            return passes * max(a + b * min(q, c), 0.0)

        qs = [float(e.record.queued_requests.sum_prefill_tokens) for e in engines]
        est = [ttft(q, e.capacity.max_num_batched_tokens) for q, e in zip(qs, engines, strict=True)]
        ratios = [x / target for x in est]
        data: dict[str, Any] = {"ttft_est_s": _summ(est), "ttft_target_s": target, "samples": fit.samples}
        cons = (
            ttft(sum(qs) / (n - 1), engines[0].capacity.max_num_batched_tokens) / target
            if n > 1
            else math.inf
        )
        kv_over = False
    else:
        target = cfg.sla.itl_ms / 1000.0
        demands = [decode_demand(e, cfg.transfer_bound_weight, 1.0) for e in engines]
        reqs = [dd.requests for dd in demands]
        kvs = [dd.tokens for dd in demands]
        a, b, c = fit.coef
        est = [max(a + b * r + c * k, 0.0) for r, k in zip(reqs, kvs, strict=True)]
        ratios = [x / target for x in est]
        caps = [e.capacity.kv_tokens for e in engines]
        kv_over = any(c and k > c for k, c in zip(kvs, caps, strict=True)) or any(
            e.capacity.max_num_seqs and r > e.capacity.max_num_seqs
            for r, e in zip(reqs, engines, strict=True)
        )
        cons = fit.predict(sum(reqs) / (n - 1), sum(kvs) / (n - 1)) / target if n > 1 else math.inf
        cap_min = min((c for c in caps if c), default=None)
        if n > 1 and cap_min and sum(kvs) / (n - 1) > cap_min * head:
            cons = math.inf
        data = {"itl_est_s": _summ(est), "itl_target_s": target, "samples": fit.samples, "kv_over": kv_over}
    if pool.replicas > pool.workers:
        cons = math.inf  # silent replicas: their load is unknown, so no consolidation
    mx = max(ratios)
    data["consolidated"] = None if not math.isfinite(cons) else round(cons, 4)
    if min(ratios) > 1.0 or kv_over:
        return Signals(
            "up", f"{pool.name} predicted latency {mx:.2f}x the SLA on every engine", mx, cons, data
        )
    if cons <= head:
        why = f"{pool.name} on {n - 1} engines predicted at {cons:.2f}x the SLA <= {head:g}"
        return Signals("down", why, mx, cons, data)
    return Signals("steady", f"{pool.name} predicted latency {mx:.2f}x the SLA", mx, cons, data)


def _summ(values: list[float]) -> dict[str, float]:
    return {"max": round(max(values), 4), "mean": round(sum(values) / len(values), 4), "n": len(values)}


def pool_signals(pool: PoolObs, cfg: PlannerConfig) -> Signals:
    if not pool.engines:
        return Signals("idle", f"{pool.name}: no engines publishing")
    if all(engine_idle(e) for e in pool.engines):
        return Signals("idle", f"{pool.name}: no scheduled or queued work on {len(pool.engines)} engines")
    if cfg.target == "sla":
        return _sla_signals(pool, cfg)
    return _threshold_signals(pool, cfg, cfg.effective_thresholds())


# --------------------------------------------------------------------------------------------------
# The decision.


@dataclass(slots=True)
class _Draft:
    name: str
    pool: PoolObs
    st: PoolState
    desired: int
    action: Action
    reason: str
    signals: dict[str, Any]
    sig: Signals | None = None


def _gpus(cfg: PlannerConfig, name: str, replicas: int) -> int:
    return replicas * cfg.pool(name).gpus_per_replica


def _held(d: _Draft) -> int:
    """Replicas that may hold GPUs right now: a draining scale-down still holds its old count."""
    n = max(d.pool.replicas, d.pool.workers, d.desired)
    if d.st.in_flight is not None:
        n = max(n, d.st.in_flight.target, d.st.in_flight.previous)
    return n


def _draft(name: str, obs: Observation, st: PoolState, cfg: PlannerConfig) -> _Draft:
    now = obs.now
    pool = obs.pool(name)
    pc = cfg.pool(name)
    cur = pool.replicas
    sig: dict[str, Any] = {"replicas": cur, "workers": pool.workers, "engines": len(pool.engines)}
    if pool.engines:
        sources: dict[str, int] = {}
        for e in pool.engines:
            src = e.capacity.source
            sources[src] = sources.get(src, 0) + 1
        sig["capacity_from"] = sources
    if pool.rejected:
        sig["rejected_records"] = pool.rejected

    def hold(reason: str, st2: PoolState = st) -> _Draft:
        return _Draft(name, pool, st2, cur, "hold", reason, sig)

    # 1. An action in flight.
    fl = st.in_flight
    if fl is not None:
        up = fl.target >= fl.previous
        reached = pool.workers >= fl.target if up else pool.workers <= fl.target
        if reached and obs.settled and cur == fl.target:
            st = replace(st, in_flight=None)
        elif now - fl.since >= cfg.action_timeout_s:
            running = min(max(pool.workers, pc.min_replicas), pc.max_replicas)
            reason = (
                f"action {fl.previous}->{fl.target} not done after {now - fl.since:.0f}s "
                f"({pool.workers} workers publishing); abandoning it and asking for {running}"
            )
            st = replace(st, in_flight=InFlight(running, fl.target, now), last_action_at=now, down_since=None)
            act: Action = "scale_up" if running > cur else "scale_down" if running < cur else "hold"
            return _Draft(name, pool, st, running, act, reason, sig)
        else:
            left = cfg.action_timeout_s - (now - fl.since)
            # ``desired`` stays the pending target: the planner still wants it (logs, metrics).
            why = (
                f"waiting for action {fl.previous}->{fl.target} ({pool.workers} publishing, "
                f"{'settled' if obs.settled else 'connector busy'}; gives up in {left:.0f}s)"
            )
            return _Draft(name, pool, st, fl.target, "hold", why, sig)

    # Outside [min, max] (a fresh deployment, a crashed replica, a changed limit): one step back in.
    if cur < pc.min_replicas:
        return _Draft(
            name, pool, st, cur + 1, "scale_up", f"{cur} replicas, below min_replicas {pc.min_replicas}", sig
        )

    if cur > pc.max_replicas:  # max lowered, or someone else scaled up: one step down
        return _Draft(
            name,
            pool,
            st,
            cur - 1,
            "scale_down",
            f"{cur} replicas, above max_replicas {pc.max_replicas}",
            sig,
        )

    # 2. Replicas vs publishing workers.
    missing = cur - pool.workers
    st = replace(
        st, mismatch_since=(st.mismatch_since if st.mismatch_since is not None else now) if missing else None
    )
    if missing:
        waited = now - (st.mismatch_since if st.mismatch_since is not None else now)
        sig["mismatch_s"] = round(waited, 3)
        if waited < cfg.mismatch_grace_s:
            what = (
                "not publishing (stale, starting or gone)"
                if missing > 0
                else "extra, not counted as replicas"
            )
            return hold(
                f"{cur} replicas but {pool.workers} workers publishing ({abs(missing)} {what}); "
                f"holding, {cfg.mismatch_grace_s - waited:.0f}s of grace left",
                replace(st, down_since=None, idle_since=None),
            )

    # 3./4. Signals.
    s = pool_signals(pool, cfg)
    sig.update(s.data)
    sig["want"] = s.want
    d = _Draft(name, pool, st, cur, "hold", s.why, sig, s)
    if s.want == "idle":
        if missing > 0:
            # Silent replicas count as busy: a NATS outage must not read as "traffic stopped".
            d.reason = s.why + f"; {missing} of {cur} replicas not publishing count as busy, no scale-down"
            d.st = replace(st, idle_since=None, down_since=None)
            return d
        since = st.idle_since if st.idle_since is not None else now
        d.st = replace(st, idle_since=since, down_since=None)
        if cur <= pc.min_replicas:
            d.reason = s.why + f"; at minimum {pc.min_replicas}"
        elif now - since >= cfg.idle_window_s:
            d.desired, d.action = cur - 1, "scale_down"
            d.reason = s.why + f" for {now - since:.0f}s; stepping down towards minimum {pc.min_replicas}"
        else:
            d.reason = s.why + f"; idle {now - since:.0f}s of {cfg.idle_window_s:g}s before stepping down"
        return d
    st = replace(st, idle_since=None)
    d.st = st
    if s.want == "up":
        d.st = replace(st, down_since=None)
        if cur >= pc.max_replicas:
            d.reason = s.why + f"; at max_replicas {pc.max_replicas}"
        else:
            d.desired, d.action = cur + 1, "scale_up"
        return d
    if s.want == "down":
        if missing > 0:
            d.reason = s.why + f"; but {missing} replicas are not publishing (counted as busy), no scale-down"
            d.st = replace(st, down_since=None)
            return d
        since = st.down_since if st.down_since is not None else now
        d.st = replace(st, down_since=since)
        if cur <= pc.min_replicas:
            d.reason = s.why + f"; at min_replicas {pc.min_replicas}"
        elif now - since >= cfg.scale_down_window_s:
            d.desired, d.action = cur - 1, "scale_down"
            d.reason = s.why + f"; wanted for {now - since:.0f}s"
        else:
            d.reason = s.why + f"; wanted for {now - since:.0f}s of {cfg.scale_down_window_s:g}s"
        return d
    d.st = replace(st, down_since=None)
    return d


def _fits_consolidated(d: _Draft, cfg: PlannerConfig) -> bool:
    """Whether this pool could give one replica away (for a rebalance) without overloading."""
    if d.sig is None or d.st.in_flight is not None or d.pool.replicas <= cfg.pool(d.name).min_replicas:
        return False
    if d.sig.want in ("idle", "down"):
        return d.pool.workers >= d.pool.replicas
    if d.sig.want != "steady" or d.sig.consolidated is None:
        return False
    limit = cfg.sla.headroom if cfg.target == "sla" else _up(d.name, cfg) * cfg.consolidation_headroom
    return d.sig.consolidated < limit and d.pool.workers >= d.pool.replicas


def _up(name: str, cfg: PlannerConfig) -> float:
    th = cfg.effective_thresholds()
    return th.prefill_up if name == "prefill" else th.decode_up


def decide(obs: Observation, state: PolicyState, cfg: PlannerConfig) -> tuple[Decision, PolicyState]:
    """One decision for both pools. Pure: same inputs, same output."""
    drafts = {name: _draft(name, obs, state.pool(name), cfg) for name in ("prefill", "decode")}
    now = obs.now

    # One step per pool per interval, even if called more often.
    for d in drafts.values():
        last = state.pool(d.name).last_action_at
        if d.action != "hold" and last is not None and now - last < cfg.interval_s * 0.999:
            d.reason += f"; last step {now - last:.1f}s ago (< interval {cfg.interval_s:g}s)"
            d.desired, d.action = d.pool.replicas, "hold"

    # GPU budget: scale-ups, the most loaded pool first.
    if cfg.gpu_budget is not None:
        budget = cfg.gpu_budget
        ups = sorted(
            (d for d in drafts.values() if d.action == "scale_up" and d.st.in_flight is None),
            key=lambda d: -(d.sig.max_load if d.sig else 0.0),
        )
        for d in ups:
            other = drafts["decode" if d.name == "prefill" else "prefill"]
            used = _gpus(cfg, d.name, _held(d)) + _gpus(cfg, other.name, _held(other))
            d.signals["gpus_after"] = used
            if used <= budget:
                continue
            want = d.desired
            d.desired, d.action = d.pool.replicas, "hold"
            if other.action == "scale_down" or other.desired < other.pool.replicas:
                d.reason += f"; GPU budget {budget} would be exceeded ({used}); waiting for {other.name} to scale down"
            elif other.action == "hold" and _fits_consolidated(other, cfg):
                other.desired, other.action = other.pool.replicas - 1, "scale_down"
                other.reason = (
                    f"rebalance: releasing one {other.name} replica so {d.name} can go to {want} "
                    f"within the GPU budget {budget} ({other.reason})"
                )
                other.st = replace(other.st, down_since=None)
                d.reason += (
                    f"; GPU budget {budget} would be exceeded ({used}); rebalancing from {other.name} first"
                )
            else:
                d.reason += (
                    f"; GPU budget {budget} would be exceeded ({used}) and {other.name} cannot give a replica"
                )

    decisions: dict[str, PoolDecision] = {}
    states: dict[str, PoolState] = {}
    for name, d in drafts.items():
        st = d.st
        if d.action != "hold" and d.desired != d.pool.replicas and st.in_flight is None:
            st = replace(
                st, in_flight=InFlight(d.desired, d.pool.replicas, now), last_action_at=now, down_since=None
            )
        if cfg.gpu_budget is not None:
            d.signals["gpu_budget"] = cfg.gpu_budget
        decisions[name] = PoolDecision(name, d.pool.replicas, d.desired, d.action, d.reason, d.signals)
        states[name] = st
    return (
        Decision(now, decisions["prefill"], decisions["decode"]),
        PolicyState(states["prefill"], states["decode"]),
    )
