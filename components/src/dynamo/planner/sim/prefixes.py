"""Prefix sharing modelled on traces that cannot show it: a seeded share of requests continue an earlier one.

A continuing request's prompt is the earlier prompt, that request's output and a new turn, so its block
hashes start with the earlier request's full prompt blocks and go on with fresh ones. The trace's own lengths
are kept: among a few earlier requests picked at random from the lookback window, the one with the longest
conversation that still fits the prompt is continued; when none fits, the shortest one's prompt is shared as
far as the prompt's length allows (a truncated prefix, as close as the lengths allow).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

BLOCK_TOKENS = 64
# Half of the requests continue an earlier conversation: a multi-turn service's later turns carry their
# history, and half keeps both shared and fresh prompts in every window so the router's choice shows.
DEFAULT_SHARE = 0.5
# How far back (seconds of trace time) a continued conversation may have started: a user's next turn comes
# within minutes.
LOOKBACK_S = 600.0
_PICKS = 8  # earlier requests looked at per continuation


def block_hashes(
    rows: Sequence[tuple[float, int, int]],
    share: float = DEFAULT_SHARE,
    seed: int = 0,
    lookback_s: float = LOOKBACK_S,
) -> list[list[int]]:
    """One list of block hash ids per row ((arrival ms, isl, osl), in arrival order): one id per 64 prompt
    tokens, fresh ids except where the request continues an earlier one."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be within [0, 1], got {share:g}")
    rng = random.Random(f"prefixes/{seed}")
    out: list[list[int]] = []
    next_id = 0
    lo = 0  # the first row within the lookback window
    for i, (t_ms, isl, _osl) in enumerate(rows):
        while lo < i and rows[lo][0] < t_ms - lookback_s * 1000.0:
            lo += 1
        blocks = -(-isl // BLOCK_TOKENS)
        prefix: list[int] = []
        if lo < i and rng.random() < share:
            j = _pick(rows, rng, lo, i, isl)
            keep = min(rows[j][1], isl) // BLOCK_TOKENS  # full blocks only: a partial block is not shared
            prefix = out[j][:keep]
        ids = prefix + list(range(next_id, next_id + blocks - len(prefix)))
        next_id += blocks - len(prefix)
        out.append(ids)
    return out


def _pick(rows: Sequence[tuple[float, int, int]], rng: random.Random, lo: int, hi: int, isl: int) -> int:
    picks = [rng.randrange(lo, hi) for _ in range(_PICKS)]
    fitting = [j for j in picks if rows[j][1] + rows[j][2] <= isl]
    if fitting:
        return max(fitting, key=lambda j: (rows[j][1] + rows[j][2], -j))
    return min(picks, key=lambda j: (rows[j][1], j))


def shared_share(hashes: Sequence[Sequence[int]]) -> float:
    """The share of prompt blocks whose id appeared in an earlier request (what a perfect cache would hit)."""
    seen: set[int] = set()
    total = hit = 0
    for ids in hashes:
        total += len(ids)
        hit += sum(1 for h in ids if h in seen)
        seen.update(ids)
    return hit / total if total else 0.0
