"""The passes over both pools' drafts: the interval guard, decode following prefill, the GPU budget."""

from __future__ import annotations

from dataclasses import replace

from ..config import PlannerConfig
from .rules import Draft
from .state import PolicyState, PoolName, other


def _fits_consolidated(d: Draft, cfg: PlannerConfig) -> bool:
    """Whether this pool could give one replica away (for a rebalance): its sizing wants fewer, and every
    replica publishes (a silent one may be loaded)."""
    s = d.sizing
    if s is None or d.st.in_flight is not None or d.pool.replicas <= cfg.pool(d.name).min_replicas:
        return False
    return s.want in ("idle", "down") and d.pool.workers >= d.pool.replicas


def apply_interval_guard(
    drafts: dict[PoolName, Draft], state: PolicyState, cfg: PlannerConfig, now: float
) -> None:
    """At most one action per pool per interval, even if decide() is called more often (half an interval of
    slack)."""
    for d in drafts.values():
        last = state.pool(d.name).last_action_at
        if (
            d.action != "hold"
            and d.desired != d.pool.replicas
            and last is not None
            and now - last < cfg.interval_s * 0.5
        ):
            d.reason += f"; last step {now - last:.1f}s ago (< interval {cfg.interval_s:g}s)"
            d.desired, d.action, d.code = d.replicas, "hold", "interval_guard"


def apply_decode_follows_prefill(drafts: dict[PoolName, Draft]) -> None:
    """While the prefill pool scales up (asked for now, or still starting), decode does not scale down.

    In disaggregated serving every prompt prefill takes on becomes decode work one prefill later, so a
    prefill scale-up says arrivals rose before the decode engines' records can (numbers: docs/planner.md).
    Only the sizing's scale-downs (load, idle) are held: bounds, abandoned actions and rebalances are not;
    and only while prefill workers publish (an aggregated deployment has none to scale).
    """
    pre, dec = drafts["prefill"], drafts["decode"]
    if pre.pool.workers == 0:
        return
    fl = pre.st.in_flight
    if pre.action == "scale_up":
        to = pre.desired
    elif fl is not None and fl.target > fl.previous:
        to = fl.target
    else:
        return
    if dec.action != "scale_down" or dec.sizing is None or dec.sizing.want not in ("down", "idle"):
        return
    dec.desired, dec.action, dec.code = dec.pool.replicas, "hold", "decode_follows_prefill"
    dec.reason += f"; held: prefill is scaling up to {to} (decode work follows)"
    dec.signals = replace(dec.signals, prefill_rising_to=to)


def _holding(d: Draft) -> int:
    """Replicas that may hold GPUs before this decision: a draining scale-down still holds its old count."""
    n = max(d.pool.replicas, d.pool.workers, d.replicas)
    if d.st.in_flight is not None:
        n = max(n, d.st.in_flight.target, d.st.in_flight.previous)
    return n


def _held(d: Draft) -> int:
    """Replicas that may hold GPUs once this decision is sent."""
    return max(_holding(d), d.desired)


def apply_budget(drafts: dict[PoolName, Draft], cfg: PlannerConfig) -> None:
    """Scale-ups, the most loaded pool first, within the GPU budget; a cut ask, or a rebalance."""
    budget = cfg.gpu_budget
    if budget is None:
        return
    ups = sorted(
        (d for d in drafts.values() if d.action == "scale_up"),
        key=lambda d: -(d.sizing.load_max if d.sizing else 0.0),
    )
    for d in ups:
        o = drafts[other(d.name)]
        gpr = cfg.pool(d.name).gpus_per_replica
        used = _held(d) * gpr + _held(o) * cfg.pool(o.name).gpus_per_replica
        d.signals = replace(d.signals, gpus_after=used)
        if used <= budget:
            continue
        want = d.desired
        base = _holding(d)
        free = budget - _held(o) * cfg.pool(o.name).gpus_per_replica
        fits = free // gpr if gpr else want
        if fits > base:
            d.desired, d.code = min(want, fits), "gpu_budget_cut"
            d.reason += f"; cut to {d.desired} by the GPU budget {budget}"
            after = d.desired * gpr + _held(o) * cfg.pool(o.name).gpus_per_replica
            d.signals = replace(d.signals, gpus_after=after)
            continue
        d.desired, d.action, d.code = d.replicas, "hold", "gpu_budget_wait"
        if o.action == "scale_down" or o.desired < o.pool.replicas:
            d.reason += (
                f"; GPU budget {budget} would be exceeded ({used}); waiting for {o.name} to scale down"
            )
        elif o.action == "hold" and _fits_consolidated(o, cfg):
            o.desired, o.action, o.code = o.pool.replicas - 1, "scale_down", "gpu_budget_rebalance"
            o.reason = (
                f"rebalance: releasing one {o.name} replica so {d.name} can go to {want} "
                f"within the GPU budget {budget} ({o.reason})"
            )
            d.reason += f"; GPU budget {budget} would be exceeded ({used}); rebalancing from {o.name} first"
        else:
            d.reason += f"; GPU budget {budget} would be exceeded ({used}) and {o.name} cannot give a replica"
