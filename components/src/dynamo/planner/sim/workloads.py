"""Production-like workloads: the Azure traces replayed (x1, x2, x4) and seeded generated families.

Unlike the suite of ``scenarios.py`` (normal lengths, steps and waves, no sharing), these carry heavy-tailed
lengths, shared prefixes and drifting, bursty arrivals. They run on long-context engines (below) and start
from the fleet the load needs (measured with ``baselines.cheapest_static_pools``, round-robin router; the
benchmark re-searches it per router). docs/planner-evaluation.md, "Real traffic", lists them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import generators as gen
from .azure import azure_rows, compressed
from .azure_csv import mooncake_requests
from .prefixes import DEFAULT_SHARE, LOOKBACK_S, block_hashes

# Long-context engines: prefill 8192 and decode 4096 blocks of 64 tokens, 64 sequences, 256k context.
LONG_CONTEXT = {
    "prefill": {"engine": {"num_gpu_blocks": 8192, "max_num_seqs": 64, "max_model_len": 262144}},
    "decode": {"engine": {"num_gpu_blocks": 4096, "max_num_seqs": 64, "max_model_len": 262144}},
}
SLA_TTFT_MS = 2000.0
SLA_ITL_MS = 50.0

Build = Callable[[int, float], list[dict[str, Any]]]  # (seed, prefix share) -> Mooncake requests


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    build: Build
    initial: tuple[int, int]  # the cheapest static fleet reaching 95% (round-robin router)
    family: str  # "azure" (held out: real traffic) or "generated" (held out: new shapes)


def _azure(trace: str, speedup: float) -> Build:
    def build(seed: int, share: float) -> list[dict[str, Any]]:
        return mooncake_requests(compressed(azure_rows(trace), speedup), share, seed, LOOKBACK_S / speedup)

    return build


def _generated(make: Callable[[random.Random, int], list[dict[str, Any]]], shares: bool) -> Build:
    """A generated family; ``shares``: whether the prefix share applies on top (sessions share by design)."""

    def build(seed: int, share: float) -> list[dict[str, Any]]:
        reqs = make(random.Random(seed), seed)
        if shares and share > 0:
            rows = [(float(r["timestamp"]), int(r["input_length"]), int(r["output_length"])) for r in reqs]
            for r, ids in zip(reqs, block_hashes(rows, share, seed), strict=True):
                r["hash_ids"] = ids
        return reqs

    return build


GENERATED_S = 600.0  # 10 minutes each: several engines per pool at the peak, a replay of under a minute


def _bursty(rng: random.Random, seed: int) -> list[dict[str, Any]]:
    rate = gen.gamma_modulated(32.0, 0.5, 60.0, seed)
    times = gen.arrivals(rate, 128.0, GENERATED_S, rng)
    return gen.single_turn(times, gen.CONV_PROMPT, gen.CONV_OUTPUT, rng)


def _diurnal(rng: random.Random, seed: int) -> list[dict[str, Any]]:
    # The rising half of a 20-minute wave: 8 -> 24 req/s.
    rate = gen.drifting(lambda t: 16.0, 0.5, 2 * GENERATED_S, phase=-math.pi / 2)
    times = gen.arrivals(rate, 24.0, GENERATED_S, rng)
    return gen.single_turn(times, gen.CODE_PROMPT, gen.CODE_OUTPUT, rng)


def _sessions(rng: random.Random, seed: int) -> list[dict[str, Any]]:
    rate = gen.drifting(gen.gamma_modulated(6.0, 0.3, 60.0, seed), 0.3, GENERATED_S)
    starts = gen.arrivals(rate, 30.0, GENERATED_S, rng)
    reqs = gen.sessions(
        starts, gen.CONV_PROMPT, gen.LogNormal(200, 1200, 1, 16384), gen.CONV_OUTPUT, 4.0, 30.0, rng
    )
    return [r for r in reqs if float(r["timestamp"]) < GENERATED_S * 1000.0]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        *(
            Workload(
                f"azure-{trace}-x{speed}",
                f"Azure 2023 {what} trace, one hour{'' if speed == 1 else f' compressed {speed}x'}, "
                f"{DEFAULT_SHARE:.0%} of requests continuing an earlier one",
                _azure(trace, float(speed)),
                initial,
                "azure",
            )
            for trace, what, fleets in (
                ("conv", "conversation", {1: (1, 1), 2: (1, 1), 4: (1, 2), 8: (2, 4), 16: (4, 7)}),
                ("code", "coding", {1: (1, 1), 2: (2, 1), 4: (3, 1), 8: (4, 1), 16: (5, 2)}),
            )
            for speed, initial in fleets.items()
        ),
        Workload(
            "gen-bursty",
            "10 min of conversation-like lengths (lognormal fits) at a Gamma-modulated 32 req/s "
            "(cv 0.5, a new rate each minute), half the requests continuing an earlier one",
            _generated(_bursty, shares=True),
            (2, 3),
            "generated",
        ),
        Workload(
            "gen-diurnal",
            "10 min of coding-like lengths (prompt p50 1.5k, output p50 13) at a rate drifting "
            "8 -> 24 req/s, half the requests continuing an earlier one",
            _generated(_diurnal, shares=True),
            (2, 1),
            "generated",
        ),
        Workload(
            "gen-sessions",
            "10 min of multi-turn conversations (4 turns on average, 30 s apart, prompts growing by each "
            "output and a new message, sharing the previous turn's blocks), 6 starts/s, bursty, drifting",
            _generated(_sessions, shares=False),
            (2, 3),
            "generated",
        ),
    )
}


def workload_requests(name: str, seed: int = 0, share: float = DEFAULT_SHARE) -> list[dict[str, Any]]:
    """The workload's requests (Mooncake fields) in arrival order."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name].build(seed, share)


def write_workload(name: str, path: str | Path, seed: int = 0, share: float = DEFAULT_SHARE) -> Path:
    """Write the workload's trace as Mooncake JSON lines; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in workload_requests(name, seed, share):
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return out
