"""Seeded traffic of the production traces' character, for shapes the planner was not tuned on.

Small pieces that compose: lengths from a lognormal fitted to two percentiles (heavy tails: the Azure
traces' prompt p90 is 2.7-3.5x their p50), arrivals from a Poisson process whose rate is itself random
(Gamma-modulated: bursts) and drifts (a diurnal-like wave), and multi-turn sessions whose prompts grow by each
turn's output and a new message, sharing the previous turn's blocks. Same arguments and seed, same rows.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .prefixes import BLOCK_TOKENS

_Z90 = 1.2815515655446004  # the standard normal's 90th percentile


@dataclass(frozen=True)
class LogNormal:
    """A length distribution: median ``p50``, 90th percentile ``p90``, clamped to [``low``, ``high``]."""

    p50: float
    p90: float
    low: int = 1
    high: int = 131072

    def draw(self, rng: random.Random) -> int:
        sigma = math.log(self.p90 / self.p50) / _Z90
        return min(max(round(rng.lognormvariate(math.log(self.p50), sigma)), self.low), self.high)


# Fitted to the Azure 2023 traces' percentiles (prompt and output p50/p90; conversation max prompt 14,050).
CONV_PROMPT = LogNormal(1020, 2734, 2, 16384)
CONV_OUTPUT = LogNormal(129, 424, 1, 2048)
CODE_PROMPT = LogNormal(1469, 5186, 3, 16384)
CODE_OUTPUT = LogNormal(13, 55, 1, 2048)

Rate = Callable[[float], float]


def gamma_modulated(mean: float, cv: float, segment_s: float, seed: int = 0) -> Rate:
    """A rate that holds a Gamma-distributed value (mean ``mean``, coefficient of variation ``cv``) for each
    ``segment_s``-second segment: bursts and lulls at random."""
    if mean <= 0 or cv < 0 or segment_s <= 0:
        raise ValueError("gamma_modulated: mean and segment_s must be > 0, cv >= 0")
    values: list[float] = []
    rng = random.Random(f"gamma/{seed}")

    def rate(t: float) -> float:
        k = int(t // segment_s)
        while len(values) <= k:
            values.append(mean if cv == 0 else rng.gammavariate(1 / cv**2, mean * cv**2))
        return values[k]

    return rate


def drifting(base: Rate, amplitude: float, period_s: float, phase: float = 0.0) -> Rate:
    """``base`` times a slow wave, 1 + ``amplitude`` sin(2 pi t / ``period_s`` + ``phase``): diurnal drift."""
    if not 0 <= amplitude < 1:
        raise ValueError(f"drifting: amplitude must be within [0, 1), got {amplitude:g}")
    return lambda t: base(t) * (1 + amplitude * math.sin(2 * math.pi * t / period_s + phase))


def arrivals(rate: Rate, peak: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Arrival times (s) of a Poisson process with time-varying ``rate`` <= ``peak`` (thinning)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if rng.random() * peak < min(rate(t), peak):
            yield t


Request = dict[str, Any]


def single_turn(
    times: Iterator[float], prompt: LogNormal, output: LogNormal, rng: random.Random
) -> list[Request]:
    """One request per arrival, its own blocks (no sharing), lengths from the two distributions."""
    out: list[Request] = []
    next_id = 0
    for t in times:
        isl, osl = prompt.draw(rng), output.draw(rng)
        blocks = -(-isl // BLOCK_TOKENS)
        out.append(_request(t, isl, osl, list(range(next_id, next_id + blocks))))
        next_id += blocks
    return out


def sessions(
    starts: Iterator[float],
    first: LogNormal,
    turn: LogNormal,
    output: LogNormal,
    mean_turns: float,
    think_s: float,
    rng: random.Random,
    max_isl: int = 131072,
) -> list[Request]:
    """Multi-turn conversations: one starts at each arrival, has a geometric number of turns (mean
    ``mean_turns``), each ``think_s`` seconds (exponential) after the previous one's arrival; a turn's prompt
    is the previous prompt, its output and a new message (``turn``), its block hashes the previous prompt's
    full blocks followed by fresh ones. A conversation ends early where its prompt would pass ``max_isl``."""
    out: list[Request] = []
    next_id = 0
    for start in starts:
        t = start
        isl = first.draw(rng)
        ids: list[int] = []
        while True:
            fresh = -(-isl // BLOCK_TOKENS) - len(ids)
            ids = ids + list(range(next_id, next_id + fresh))
            next_id += fresh
            osl = output.draw(rng)
            out.append(_request(t, isl, osl, ids))
            if rng.random() < 1 / mean_turns:
                break
            grown = isl + osl + turn.draw(rng)
            if grown > max_isl:
                break
            ids = ids[: isl // BLOCK_TOKENS]  # the previous prompt's full blocks
            isl = grown
            t += rng.expovariate(1 / think_s)
    out.sort(key=_arrival)
    return out


def _arrival(r: Request) -> float:
    t = r["timestamp"]
    assert isinstance(t, float)
    return t


def _request(t: float, isl: int, osl: int, ids: list[int]) -> Request:
    return {"timestamp": round(t * 1000.0, 3), "input_length": isl, "output_length": osl, "hash_ids": ids}
