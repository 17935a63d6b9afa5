"""The scaling policy: a pure function from observations and a small state to a decision with reasons.

No I/O, no clock (``Observation.now`` is passed in), no randomness, so every rule is testable in
microseconds and replayable offline. Per pool, ordered rules (each a named function in ``rules``, like
the stages of Kubernetes' HPA) draft a decision; then the interval guard and the GPU budget apply to both:

0. ``rule_first_look``: the fleet found at the planner's first decision is recorded as a need, so the
   stabilization holds it (the HPA's initial recommendation).
1. ``rule_in_flight``: replicas asked for and still starting are capacity to come (the pool sizes on
   top of them instead of waiting); a scale-down in flight holds until the replicas publishing are
   down to its target (and, with a GPU budget, until the connector settles); an action not done after
   ``action_timeout_s`` is given up and the pool asks for what is actually running.
2. ``rule_bounds``: outside [min, max] -> back in (down by at most ``scale_down_step``).
3. ``rule_mismatch``: replicas != publishing workers (beyond those starting): hold for
   ``mismatch_grace_s``, then decide with the silent ones counted as loaded (never a scale-down).
4. ``rule_idle``: no engine publishes -> hold (silent replicas count as busy).
5. ``rule_load``: the sizing (``robust``): each pool carries the mean plus ``headroom_sigmas`` standard
   deviations of its demand over ``demand_window_s`` (and today's demand) at ``up``; several replicas may be
   added at once. Down never below the highest need of ``scale_down_stabilization_s``, by at most
   ``scale_down_step``; a pool idle for a whole demand window needs none. The opt-in ``forecast`` adds a
   consistent trend's growth over a startup.
6. ``apply_interval_guard``, ``apply_decode_follows_prefill`` and ``apply_budget``: at most one action per
   pool per interval; no decode scale-down while prefill scales up; the GPU budget is never exceeded
   (draining replicas still count), an ask that does not fit is cut to what fits, and if nothing fits the
   other pool gives a replica when its sizing wants fewer.

``settle()`` applies the connector's outcome (sent, failed, dry run) to the state, so the loop and the
replay never edit policy state themselves.

The modules, each with one job: ``state`` (names, what a pool remembers), ``decision`` (signals, sizing,
decisions), ``demand`` and ``trend`` (an engine's work; sample windows and their line), ``view`` (what a
sizing reads, shared arithmetic), ``decode``, ``prefill`` and ``sla`` (the three sizings), ``robust`` (up /
down / steady from the demand window), ``forecast`` (the opt-in trend), ``sizing`` (which sizing a pool
gets), ``rules`` (the per-pool rules), ``fleet`` (the passes over both pools) and ``step`` (``decide`` and
``settle``).
"""

from __future__ import annotations

from .decision import Decision, PoolDecision, Signals, Sizing, Summary
from .decode import decode_sizing
from .demand import DecodeDemand, decode_demand, decode_load, engine_idle
from .fleet import apply_budget, apply_decode_follows_prefill, apply_interval_guard
from .prefill import arrival_engines, prefill_sizing
from .rules import (
    Draft,
    draft_pool,
    rule_bounds,
    rule_first_look,
    rule_idle,
    rule_in_flight,
    rule_load,
    rule_mismatch,
)
from .sizing import pool_sizing
from .state import POOLS, Action, InFlight, PolicyState, PoolName, PoolState, Want, other
from .step import decide, sent_now, settle
from .trend import trend_fit, trend_slope
from .view import PoolView

__all__ = [
    "POOLS",
    "Action",
    "Decision",
    "DecodeDemand",
    "Draft",
    "InFlight",
    "PolicyState",
    "PoolDecision",
    "PoolName",
    "PoolState",
    "PoolView",
    "Signals",
    "Sizing",
    "Summary",
    "Want",
    "apply_budget",
    "apply_decode_follows_prefill",
    "apply_interval_guard",
    "arrival_engines",
    "decide",
    "decode_demand",
    "decode_load",
    "decode_sizing",
    "draft_pool",
    "engine_idle",
    "other",
    "pool_sizing",
    "prefill_sizing",
    "rule_bounds",
    "rule_first_look",
    "rule_idle",
    "rule_in_flight",
    "rule_load",
    "rule_mismatch",
    "sent_now",
    "settle",
    "trend_fit",
    "trend_slope",
]
