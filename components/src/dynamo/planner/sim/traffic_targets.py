"""Issue 31's targets on the production-like workloads, as data and a pure check of one run.

From the fleet the load needs: at a 0 s cold start, goodput >= 95% with GPU-hours <= 1.05x those of the
cheapest static P+D fleet reaching 95% on the same trace; at 60 s, >= 95% at <= 1.15x. From 1+1 at 0 s:
>= 93%. Everywhere: at most 2 changes of direction per pool per 30 minutes of traffic (a run shorter than
30 minutes is allowed 2: one flip in a 15-minute trace is not 2.07 per 30 minutes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GOODPUT_PCT = 95.0
GOODPUT_FROM_ONE_PCT = 93.0
GPU_HOURS_RATIO = {0.0: 1.05, 60.0: 1.15}
FLIPS_PER_30_MIN = 2.0
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Verdict:
    """One run against its targets; ``None`` where a target does not apply (or has no static fleet)."""

    goodput_ok: bool
    gpu_hours_ratio: float | None
    gpu_hours_ok: bool | None
    flips_per_30_min: dict[str, float]
    flips_ok: bool

    @property
    def met(self) -> bool:
        return self.goodput_ok and self.gpu_hours_ok is not False and self.flips_ok


def flips_per_30_min(summary: Mapping[str, Any]) -> dict[str, float]:
    """Each pool's changes of direction per 30 minutes of the run's simulated time."""
    halves = max(float(summary["duration_s"]), 1.0) / 1800.0
    return {p: float(summary["flips"][p]) / halves for p in POOLS}


def judge(
    summary: Mapping[str, Any], startup_s: float, from_one: bool, static_gpu_hours: float | None
) -> Verdict:
    """A planner run's verdict: ``from_one`` for a run that starts from 1+1 (goodput only, and flips)."""
    goodput = float(summary["goodput_pct"])
    ratio = None if not static_gpu_hours else float(summary["gpu_hours"]) / static_gpu_hours
    flips = flips_per_30_min(summary)
    halves = max(float(summary["duration_s"]) / 1800.0, 1.0)
    flips_ok = all(float(summary["flips"][p]) <= FLIPS_PER_30_MIN * halves for p in POOLS)
    if from_one:
        return Verdict(goodput >= GOODPUT_FROM_ONE_PCT, ratio, None, flips, flips_ok)
    bound = GPU_HOURS_RATIO.get(startup_s)
    ratio_ok = None if bound is None or ratio is None else ratio <= bound
    return Verdict(goodput >= GOODPUT_PCT, ratio, ratio_ok, flips, flips_ok)
