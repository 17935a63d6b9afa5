"""One decision for both pools (``decide``), and the connector's outcome applied to the state (``settle``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ..config import PlannerConfig
from ..observations import Observation
from .decision import Decision, PoolDecision, Signals
from .fleet import apply_budget, apply_decode_follows_prefill, apply_interval_guard
from .rules import Draft, draft_pool
from .state import POOLS, InFlight, PolicyState, PoolName


def _signals(d: Draft) -> Signals:
    s = d.sizing
    if s is None:
        return d.signals
    return d.signals.merged(Signals(demand=s.demand, projected=s.projected))


def decide(obs: Observation, state: PolicyState, cfg: PlannerConfig) -> tuple[Decision, PolicyState]:
    """One decision for both pools. Pure: same inputs, same output."""
    drafts = {name: draft_pool(name, obs, state.pool(name), cfg) for name in POOLS}
    now = obs.now
    apply_interval_guard(drafts, state, cfg, now)
    apply_decode_follows_prefill(drafts)
    apply_budget(drafts, cfg)
    decisions: dict[PoolName, PoolDecision] = {}
    new_state = state
    for name, d in drafts.items():
        st = d.st
        # A new target: more than the capacity already counted (running + starting), or a scale-down.
        if d.action != "hold" and d.desired != (d.replicas if d.action == "scale_up" else d.pool.replicas):
            fl = st.in_flight
            previous = fl.previous if fl is not None and d.action == "scale_up" else d.pool.replicas
            st = replace(
                st,
                in_flight=InFlight(d.desired, previous, now),
                last_action_at=now,
            )
            if d.action == "scale_up" and st.startup_probe is None:
                # This ask's first replica is the one after everything already running or starting
                # (``d.replicas``): counting from the workers publishing now would time an earlier
                # ask's replica, which lands sooner (measured 28 s on a 60 s cold start).
                st = replace(st, startup_probe=(now, max(d.replicas, d.pool.workers)))
        if cfg.gpu_budget is not None:
            d.signals = replace(d.signals, gpu_budget=cfg.gpu_budget)
        decisions[name] = PoolDecision(
            name,
            d.pool.replicas,
            d.desired,
            d.action,
            d.reason,
            d.pool.workers,
            len(d.pool.engines),
            d.sizing,
            _signals(d),
            d.code,
        )
        new_state = new_state.with_pool(name, st)
    return Decision(now, decisions["prefill"], decisions["decode"]), new_state


def sent_now(state: PolicyState, now: float) -> list[PoolName]:
    """Pools whose new target was set at ``now`` (what the loop must send to the connector)."""
    return [p for p in POOLS if (fl := state.pool(p).in_flight) is not None and fl.since == now]


def settle(state: PolicyState, *, dry_run: bool = False, failed: Iterable[PoolName] = ()) -> PolicyState:
    """The connector's outcome applied to the state: nothing will happen (dry run), or a send failed.

    A dry run waits for nothing; a failed send clears that pool's in-flight action so the policy asks
    again at the next interval instead of waiting for an action that never started.
    """
    failed = set(failed)
    for p in POOLS:
        st = state.pool(p)
        if dry_run or p in failed:
            state = state.with_pool(p, replace(st, in_flight=None, startup_probe=None))
    return state
