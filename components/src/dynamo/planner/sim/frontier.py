"""What a scenario allows at a given cold start: fleets scripted from each phase's measured need.

A planner is judged against what is possible, not against 100%. For a scenario made of phases, each
phase's need is measured on its own (the cheapest prefill count with decode ample, and the reverse,
each reaching the goodput target on that phase's requests alone, on a fleet ready from the start).
Two scripted fleets then follow those needs through the whole trace, cold starts and all:

- **reactive**: a pool grows ``reaction_s`` after a phase that needs more begins (the earliest a planner
  that sees the load could ask) and shrinks when the phase begins -- the best any reactive policy can do
  with right-sized steps;
- **clairvoyant**: a pool grows one cold start before the phase begins, so its replicas are ready on
  time -- what perfect foresight gets, the ceiling.

Neither over-provisions to drain a backlog, so a real planner can beat the reactive one by adding extra
replicas; the clairvoyant one is the upper bound of right-sized fleets.

- **reactive with overshoot** (``overshoot_script``): the reactive fleet, with ``extra`` replicas on each pool
  whose need grew, held ``hold_s`` after the ask (at most to the phase's end) to drain the backlog of the
  cold start. A grid of (extra, hold) traces what a reactive planner that knows each phase's need can buy
  for its GPU-hours; ``pareto_front`` keeps the points no other beats on both.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from .baselines import smallest_passing
from .harness import Script, SimSpec, simulate
from .scenarios import Scenario, requests

AMPLE = 16  # replicas of the other pool while one pool's need is searched (the fleet scale needs 64)


@dataclass(frozen=True)
class PhaseNeed:
    start_s: float
    end_s: float
    prefill: int
    decode: int


def _ms(request: dict[str, object]) -> float:
    value = request["timestamp"]
    assert isinstance(value, int | float)
    return float(value)


def phase_needs(
    scenario: Scenario,
    spec: SimSpec,
    seed: int = 0,
    target_pct: float = 95.0,
    max_n: int = 64,
    ample: int = AMPLE,
) -> list[PhaseNeed]:
    """Each phase's (prefill, decode) need, measured on that phase's requests alone (cold start 0).

    One pool's need is searched with ``ample`` replicas of the other: too few, and the other pool's
    shortage reads as this one's (the fleet scale's 200 req/s phase asked for 64 of each with 16).
    """
    all_requests = list(requests(scenario, seed))
    out: list[PhaseNeed] = []
    start = 0.0
    with tempfile.TemporaryDirectory(prefix="dynamo-frontier-") as tmp:
        for i, phase in enumerate(scenario.phases):
            end = start + phase.duration_s
            rows = [r for r in all_requests if start * 1000.0 <= _ms(r) < end * 1000.0]
            if not rows:
                out.append(PhaseNeed(start, end, 1, 1))
                start = end
                continue
            path = Path(tmp) / f"phase-{i}.jsonl"
            with path.open("w", encoding="utf-8") as f:
                for r in rows:
                    shifted = dict(r, timestamp=round(_ms(r) - start * 1000.0, 3))
                    f.write(json.dumps(shifted, separators=(",", ":")) + "\n")
            base = replace(spec, traces=(str(path),), trace_duration_s=phase.duration_s, initial=(1, 1))

            def ok(fleet: tuple[int, int], base: SimSpec = base) -> bool:
                s = simulate(replace(base, static=fleet), None)["summary"]
                return float(s["goodput_pct"]) >= target_pct

            # None: not even max_n reaches the target; the script then asks for max_n.
            p = smallest_passing(lambda n: ok((n, ample)), max_n) or max_n
            d = smallest_passing(lambda n: ok((ample, n)), max_n) or max_n
            out.append(PhaseNeed(start, end, p, d))
            start = end
    return out


def _phase_at(needs: list[PhaseNeed], t: float) -> PhaseNeed:
    for n in needs:
        if t < n.end_s:
            return n
    return needs[-1]


def reactive_script(needs: list[PhaseNeed], reaction_s: float = 5.0) -> Script:
    """Grow ``reaction_s`` after a phase begins, shrink when it begins."""

    def script(t: float) -> tuple[int, int]:
        now, before = _phase_at(needs, t), _phase_at(needs, max(t - reaction_s, 0.0))
        return min(now.prefill, before.prefill), min(now.decode, before.decode)

    return script


def clairvoyant_script(needs: list[PhaseNeed], startup_s: float) -> Script:
    """Grow one cold start before a phase begins (ready on time), shrink when it begins."""

    def script(t: float) -> tuple[int, int]:
        # Every phase that starts within one cold start, not only the one at its end (a short burst).
        soon = [n for n in needs if n.end_s > t and n.start_s <= t + startup_s] or [needs[-1]]
        return max(n.prefill for n in soon), max(n.decode for n in soon)

    return script


def overshoot_script(
    needs: list[PhaseNeed],
    extra: int,
    hold_s: float,
    reaction_s: float = 5.0,
    initial: tuple[int, int] = (1, 1),
) -> Script:
    """The reactive fleet plus ``extra`` replicas on each pool whose need grew, for ``hold_s`` after the ask.

    A pool's need grew when the phase needs more than the one before it (the first phase: more than the
    ``initial`` fleet). The extra replicas leave when ``hold_s`` has passed or the phase ends, whichever
    comes first; a phase that needs less shrinks the pool when it begins, as the reactive fleet does.
    """
    before_first = PhaseNeed(0.0, 0.0, *initial)

    def script(t: float) -> tuple[int, int]:
        now = _phase_at(needs, t)
        i = needs.index(now)
        prev = needs[i - 1] if i else before_first
        since = t - now.start_s
        if since < reaction_s:  # not seen yet: the smaller of the two phases' fleets
            return min(now.prefill, prev.prefill), min(now.decode, prev.decode)
        boost = extra if since < reaction_s + hold_s else 0
        prefill = now.prefill + (boost if now.prefill > prev.prefill else 0)
        decode = now.decode + (boost if now.decode > prev.decode else 0)
        return prefill, decode

    return script


P = TypeVar("P")


def pareto_front(points: Iterable[P], goodput: Callable[[P], float], cost: Callable[[P], float]) -> list[P]:
    """The points no other point beats (at least the goodput for less, or more goodput for no more),
    cheapest first; of points with the same goodput and cost, the first given."""
    front: list[P] = []
    for p in sorted(points, key=lambda p: (cost(p), -goodput(p))):  # stable: ties keep their order
        if not front or goodput(p) > goodput(front[-1]):
            front.append(p)
    return front


def overshoot_frontier(
    spec: SimSpec,
    needs: list[PhaseNeed],
    extras: Sequence[int] = (1, 2, 3, 4, 5, 6),
    holds_s: Sequence[float] = (30.0, 60.0, 120.0, 180.0, 240.0),
    reaction_s: float = 5.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (extra, hold) point's summary, with ``extra`` and ``hold_s`` added, the right-sized one first.

    ``progress(done, total)`` is called after each point (a fleet-scale point replays for ~40 s).
    """
    grid = [(0, 0.0), *((e, h) for e in extras for h in holds_s)]
    out = []
    for extra, hold in grid:
        script = overshoot_script(needs, extra, hold, reaction_s, spec.initial)
        summary = simulate(spec, None, script=script)["summary"]
        out.append({"extra": extra, "hold_s": hold, **summary})
        if progress is not None:
            progress(len(out), len(grid))
    return out


def frontier(
    scenario: Scenario, spec: SimSpec, needs: list[PhaseNeed], reaction_s: float = 5.0
) -> dict[str, dict[str, Any]]:
    """The reactive and clairvoyant scripted fleets' summaries on the scenario at ``spec``'s cold start."""
    return {
        "reactive": simulate(spec, None, script=reactive_script(needs, reaction_s))["summary"],
        "clairvoyant": simulate(spec, None, script=clairvoyant_script(needs, spec.startup_time_s))["summary"],
    }
