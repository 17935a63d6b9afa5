"""The per-pool rules, in order, that draft a pool's decision (``draft_pool``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import PlannerConfig
from ..observations import Observation, PoolObs
from .decision import Signals, Sizing
from .sizing import pool_sizing
from .state import Action, InFlight, PoolName, PoolState
from .trend import within_window
from .view import PoolView


@dataclass(slots=True)
class Draft:
    """One pool's decision in the making; each rule reads and refines it."""

    name: PoolName
    pool: PoolObs
    st: PoolState
    replicas: int  # capacity counted: running + asked for and still starting
    desired: int
    action: Action
    reason: str
    signals: Signals
    sizing: Sizing | None = None
    done: bool = False
    # The rule that made the decision (``PoolDecision.code``: what tests and dashboards match, not the prose).
    code: str = ""

    def decide(self, desired: int, reason: str, st: PoolState | None = None, *, code: str) -> Draft:
        self.desired = desired
        self.action = (
            "scale_up"
            if desired > self.pool.replicas
            else "scale_down"
            if desired < self.pool.replicas
            else "hold"
        )
        self.reason = reason
        self.code = code
        if st is not None:
            self.st = st
        self.done = True
        return self

    def hold(
        self, reason: str, st: PoolState | None = None, desired: int | None = None, *, code: str
    ) -> Draft:
        self.decide(self.pool.replicas, reason, st, code=code)
        if desired is not None:
            self.desired = desired  # the pending target: the planner still wants it (logs, metrics)
        return self


def _lead(st: PoolState, cfg: PlannerConfig) -> float:
    return st.startup_s if st.startup_s is not None else cfg.expected_startup_s


def rule_first_look(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    """A planner's first look records the fleet it found as a need, so the stabilization holds it.

    A planner that has just started (or restarted) knows nothing of the load before it: the fleet it finds
    is what the operator or its previous self sized. Like the HPA, which seeds its recommendations with the
    current replica count, it scales that fleet down no sooner than ``scale_down_stabilization_s`` (idle
    pools excepted: ``rule_idle`` does not read the needs).
    """
    if d.st.first_look_at is not None:
        return
    window = cfg.scale_down_stabilization_s
    needs = within_window(d.st.needs, window, obs.now, d.pool.replicas) if window > 0 else d.st.needs
    d.st = replace(d.st, first_look_at=obs.now, first_look_replicas=d.pool.replicas, needs=needs)


def rule_in_flight(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    """Starting replicas are capacity to come; a drain in flight holds; a stuck action is given up.

    A scale-down is done once the replicas publishing are down to its target, though the released one
    may still drain (the connector is busy): the pool is sized meanwhile. With a GPU budget it waits for
    the connector, since the draining replica still holds its GPUs and only the action in flight counts them.
    """
    fl = d.st.in_flight
    if fl is None:
        return
    now, pool = obs.now, d.pool
    up = fl.target >= fl.previous
    reached = pool.workers >= fl.target if up else pool.workers <= fl.target
    if reached and (obs.settled or up or cfg.gpu_budget is None):
        d.st = replace(d.st, in_flight=None)
        return
    if now - fl.since >= cfg.action_timeout_s:
        pc = cfg.pool(d.name)
        running = min(max(pool.workers, pc.min_replicas), pc.max_replicas)
        reason = (
            f"action {fl.previous}->{fl.target} not done after {now - fl.since:.0f}s "
            f"({pool.workers} workers publishing); abandoning it and asking for {running}"
        )
        st = replace(
            d.st,
            in_flight=InFlight(running, fl.target, now),
            last_action_at=now,
            startup_probe=None,
        )
        d.decide(running, reason, st, code="in_flight_abandoned")
        return
    left = cfg.action_timeout_s - (now - fl.since)
    state = "settled" if obs.settled else "connector busy"
    if not up:
        d.hold(
            f"waiting for action {fl.previous}->{fl.target} ({pool.workers} publishing, {state}; "
            f"gives up in {left:.0f}s)",
            desired=fl.target,
            code="in_flight_down_wait",
        )
        return
    # A scale-up in flight: size on top of it (never below what was asked for).
    d.replicas = max(d.replicas, fl.target)
    d.signals = replace(d.signals, starting=max(fl.target - pool.workers, 0))
    d.reason = (
        f"waiting for action {fl.previous}->{fl.target} ({pool.workers} publishing, {state}; "
        f"gives up in {left:.0f}s)"
    )


def rule_bounds(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    pc = cfg.pool(d.name)
    cur = d.pool.replicas
    if d.replicas < pc.min_replicas:
        d.decide(pc.min_replicas, f"{cur} replicas, below min_replicas {pc.min_replicas}", code="bounds_min")
    elif cur > pc.max_replicas:
        d.decide(
            max(cur - cfg.scale_down_step, pc.max_replicas),
            f"{cur} replicas, above max_replicas {pc.max_replicas}",
            code="bounds_max",
        )


def _starting(d: Draft, status_starting: int | None) -> int:
    """Replicas still starting: the connector's count, never more than those not publishing yet."""
    silent = max(d.replicas - d.pool.workers, 0)
    if status_starting is not None:
        return min(status_starting, silent)
    return silent if d.st.in_flight is not None else 0


def rule_mismatch(d: Draft, obs: Observation, cfg: PlannerConfig) -> int:
    """Replicas that should publish but do not (starting ones excepted): hold, then count them busy."""
    now, pool = obs.now, d.pool
    missing = pool.replicas - pool.workers - _starting(d, pool.starting)
    if pool.replicas < pool.workers:
        missing = pool.replicas - pool.workers
    elif missing < 0:
        missing = 0
    since = (d.st.mismatch_since if d.st.mismatch_since is not None else now) if missing else None
    d.st = replace(d.st, mismatch_since=since)
    if not missing:
        return 0
    waited = now - (since if since is not None else now)
    d.signals = replace(d.signals, mismatch_s=round(waited, 3))
    if waited < cfg.mismatch_grace_s:
        what = "not publishing (stale, starting or gone)" if missing > 0 else "extra, not counted as replicas"
        d.hold(
            f"{pool.replicas} replicas but {pool.workers} workers publishing ({abs(missing)} {what}); "
            f"holding, {cfg.mismatch_grace_s - waited:.0f}s of grace left",
            code="mismatch_grace",
        )
    return missing


def rule_idle(d: Draft, obs: Observation, cfg: PlannerConfig, missing: int) -> None:
    """No engine publishes: hold (silent replicas count as busy; starting ones are on their way).

    A pool whose engines publish and have no work is not idle here: its sizing needs no replica after a
    whole demand window of it, and the stabilization steps it down (``robust.robust_verdict``).
    """
    s = d.sizing
    if s is None or s.want != "idle":
        return
    pc, cur = cfg.pool(d.name), d.pool.replicas
    if missing > 0:
        # Silent replicas count as busy: a NATS outage must not read as "traffic stopped".
        d.hold(
            s.why + f"; {missing} of {cur} replicas not publishing count as busy, no scale-down",
            code="idle_silent_busy",
        )
    elif cur <= pc.min_replicas:
        d.hold(s.why + f"; at minimum {pc.min_replicas}", code="idle_at_min")
    else:
        d.hold(s.why + "; a scale-up is still starting", desired=d.replicas, code="idle_scale_up_starting")


def rule_load(d: Draft, obs: Observation, cfg: PlannerConfig, missing: int) -> None:
    s = d.sizing
    assert s is not None
    now, pc, cur = obs.now, cfg.pool(d.name), d.pool.replicas
    if s.want == "up":
        want = min(s.needed if s.needed is not None else d.replicas + 1, pc.max_replicas)
        if cfg.max_scale_up_step is not None:
            want = min(want, d.replicas + cfg.max_scale_up_step)
        if d.replicas >= pc.max_replicas:
            d.hold(
                s.why + f"; at max_replicas {pc.max_replicas}",
                desired=max(d.replicas, cur),
                code="load_up_at_max",
            )
        elif want <= d.replicas:
            d.hold(
                s.why + f"; {d.replicas} replicas (with those starting) carry it",
                desired=d.replicas,
                code="load_up_carried",
            )
        else:
            starting = d.replicas - cur
            d.decide(
                want, s.why + (f" ({starting} starting counted)" if starting > 0 else ""), code="load_up"
            )
        return
    if d.st.in_flight is not None:
        # A scale-up is still starting: never reverse it before it has landed.
        d.hold(d.reason + "; " + s.why, desired=d.replicas, code="load_up_starting")
        return
    if s.want == "down":
        window = cfg.scale_down_stabilization_s
        held = [(t, n) for t, n in d.st.needs if now - t <= window]
        recent = max((n for _, n in held), default=0)
        if recent >= cur:
            first = d.st.first_look_at
            # Found at the first look, not asked for by that tick's sizing (both are recorded at that time).
            found = recent == d.st.first_look_replicas
            if first is not None and found and all(t == first for t, n in held if n == recent):
                why = f"; the {recent} replicas found at the planner's first look {now - first:.0f}s ago"
            else:
                why = f"; {recent} replicas were needed within {window:g}s"
            d.hold(s.why + why + " (stabilization)", code="load_stabilized")
            return
        if missing > 0:
            d.hold(
                s.why + f"; but {missing} replicas are not publishing (counted as busy), no scale-down",
                code="load_silent_busy",
            )
            return
        if cur <= pc.min_replicas:
            d.hold(s.why + f"; at min_replicas {pc.min_replicas}", code="load_at_min")
            return
        to = max(pc.min_replicas, s.needed or 0, recent, cur - cfg.scale_down_step)
        d.decide(to, s.why + f"; {recent} replicas at most were needed within {window:g}s", code="load_down")
        return
    d.hold(s.why, code="sizing_hold" if s.want == "hold" else "load_steady")


def _probe_startup(st: PoolState, pool: PoolObs, now: float) -> PoolState:
    """Measure the time from a scale-up to the first record of a new replica (EWMA)."""
    probe = st.startup_probe
    if probe is None or pool.workers <= probe[1]:
        return st
    took = now - probe[0]
    est = took if st.startup_s is None else 0.5 * st.startup_s + 0.5 * took
    return replace(st, startup_s=est, startup_probe=None)


def draft_pool(name: PoolName, obs: Observation, st: PoolState, cfg: PlannerConfig) -> Draft:
    pool = obs.pool(name)
    st = _probe_startup(st, pool, obs.now)
    sources: dict[str, int] = {}
    for e in pool.engines:
        sources[e.capacity.source] = sources.get(e.capacity.source, 0) + 1
    sig = Signals(
        replicas=pool.replicas,
        workers=pool.workers,
        engines=len(pool.engines),
        capacity_from=sources or None,
        rejected_records=pool.rejected or None,
        lead_s=round(_lead(st, cfg), 1),
        startup_measured=st.startup_s is not None,
    )
    d = Draft(name, pool, st, pool.replicas, pool.replicas, "hold", "", sig)
    rule_first_look(d, obs, cfg)
    rule_in_flight(d, obs, cfg)
    if d.done:
        return d
    rule_bounds(d, obs, cfg)
    if d.done:
        return d
    missing = rule_mismatch(d, obs, cfg)
    if d.done:
        return d
    view = PoolView(
        pool,
        d.st,
        cfg,
        d.replicas,
        _lead(d.st, cfg),
        _starting(d, pool.starting),
        obs.arrivals if cfg.use_arrivals else None,
    )
    sizing, d.st = pool_sizing(view, obs.now)
    d.sizing = sizing
    if sizing.needed is not None:
        need = min(sizing.needed, cfg.pool(name).max_replicas)
        d.st = replace(d.st, needs=within_window(d.st.needs, cfg.scale_down_stabilization_s, obs.now, need))
    d.signals = replace(d.signals.merged(sizing.signals), want=sizing.want)
    rule_idle(d, obs, cfg, missing)
    if d.done:
        return d
    rule_load(d, obs, cfg, missing)
    return d
