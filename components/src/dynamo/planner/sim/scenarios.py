"""The scenario suite: seeded Mooncake traces made on demand (never checked in as big files).

Each scenario is a list of phases; a phase is ``duration_s`` of Poisson arrivals at ``rate`` requests/s
(a callable of the time in the phase for waves), prompt and output lengths normal around ``isl`` /
``osl`` with ``spread`` relative standard deviation, every request its own block hashes (no prefix
reuse; one id per 64 prompt tokens). Same name and seed, same trace, byte for byte.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Rate = float | Callable[[float], float]
BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: Rate
    isl: int
    osl: int
    peak_rate: float | None = None  # the rate's maximum, for waves (thinning)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    phases: tuple[Phase, ...]
    spread: float = 0.15
    # The fleet a deployment would run when the trace starts (prefill, decode): every policy starts there.
    initial: tuple[int, int] = (1, 1)

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)


def _wave(low: float, high: float, period_s: float) -> Callable[[float], float]:
    mid, amp = (low + high) / 2, (high - low) / 2

    def rate(t: float) -> float:
        return mid - amp * math.cos(2 * math.pi * t / period_s)

    return rate


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "decode-shift",
            "constant 4 req/s; the outputs grow 10x for 5 minutes: decode must grow, prefill must not",
            (Phase(120, 4, 1000, 150), Phase(300, 4, 1000, 1500), Phase(180, 4, 1000, 150)),
        ),
        Scenario(
            "prompt-burst",
            "5x the arrivals with 4x longer prompts for 4 minutes: prefill must grow",
            (Phase(120, 2, 2000, 100), Phase(240, 10, 8000, 60), Phase(180, 2, 2000, 100)),
        ),
        Scenario(
            "ramp",
            "arrivals ramp 2 -> 14 -> 2 req/s in minute steps (ISL 3000, OSL 800): "
            "each step as long as a cold start",
            tuple(
                Phase(d, r, 3000, 800)
                for d, r in (
                    (60, 2),
                    (60, 4),
                    (60, 7),
                    (60, 10),
                    (120, 14),
                    (60, 10),
                    (60, 7),
                    (60, 4),
                    (60, 2),
                )
            ),
        ),
        Scenario(
            "idle-gap",
            "6 req/s, then 3 minutes of nothing, then 6 req/s again: scale in, and come back",
            (Phase(150, 6, 2000, 1000), Phase(180, 0, 2000, 1000), Phase(150, 6, 2000, 1000)),
        ),
        Scenario(
            "flash-crowd",
            "2 req/s, then 8x the arrivals for 45 s, then 2 req/s",
            (Phase(120, 2, 1500, 400), Phase(45, 16, 1500, 400), Phase(255, 2, 1500, 400)),
        ),
        Scenario(
            "opposite-shift",
            "long outputs, then 10x longer prompts with 20x shorter outputs, then back: "
            "prefill up while decode goes down",
            (Phase(150, 4, 1000, 2000), Phase(300, 8, 10000, 100), Phase(150, 4, 1000, 2000)),
        ),
        Scenario(
            "slow-wave",
            "arrivals follow a 5-minute wave between 2 and 16 req/s for 15 minutes (ISL 3000, OSL 800)",
            (Phase(900, _wave(2, 16, 300), 3000, 800, peak_rate=16),),
        ),
        Scenario(
            "steady",
            "a constant 8 req/s of 8,000-token prompts (OSL 100) for 20 minutes on the fleet it needs, 2+1: "
            "two prefill engines busy without a queue, nothing to do",
            (Phase(1200, 8, 8000, 100),),
            initial=(2, 1),
        ),
        Scenario(
            "fleet-scale",
            "a fleet of 32-64 engines per pool at the peak: 60 -> 200 -> 60 req/s, ISL 6000, OSL 400",
            (Phase(120, 60, 6000, 400), Phase(240, 200, 6000, 400), Phase(180, 60, 6000, 400)),
            initial=(12, 12),  # 60 req/s is not served by 1+1: start where a deployment would be
        ),
    )
}


def scenario_names(arg: str) -> list[str]:
    """The names in a comma-separated ``--scenarios`` argument; ValueError naming the first unknown one."""
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}")
    return names


def requests(scenario: Scenario, seed: int = 0) -> Iterator[dict[str, object]]:
    """The trace's requests in arrival order (Mooncake fields)."""
    rng = random.Random(f"{scenario.name}/{seed}")
    start = 0.0
    next_hash = 0
    for phase in scenario.phases:
        peak = phase.peak_rate if phase.peak_rate is not None else phase.rate
        if not isinstance(peak, int | float) or peak <= 0:
            start += phase.duration_s
            continue
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= phase.duration_s:
                break
            if callable(phase.rate) and rng.random() * peak > phase.rate(t):
                continue  # thinning: a non-homogeneous Poisson process
            isl = max(1, round(rng.gauss(phase.isl, phase.isl * scenario.spread)))
            osl = max(1, round(rng.gauss(phase.osl, phase.osl * scenario.spread)))
            blocks = -(-isl // BLOCK_TOKENS)
            yield {
                "timestamp": round((start + t) * 1000.0, 3),
                "input_length": isl,
                "output_length": osl,
                "hash_ids": list(range(next_hash, next_hash + blocks)),
            }
            next_hash += blocks
        start += phase.duration_s


def write_trace(scenario: Scenario | str, path: str | Path, seed: int = 0) -> Path:
    """Write the scenario's trace as JSON lines; returns the path."""
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in requests(sc, seed):
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return out
