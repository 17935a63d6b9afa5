"""Traces in the Azure LLM inference format (``TIMESTAMP,ContextTokens,GeneratedTokens``), made replayable.

Azure's public traces (2023's coding and conversation hours, 2024's weeks) carry arrivals and lengths only.
``simulate --trace`` and ``bench_planner_traffic.py --trace`` take such a CSV as it is: its rows become a
Mooncake trace with the prefix sharing modelled on top (``prefixes.block_hashes``: a seeded share of requests
continue an earlier one), as the shipped Azure workloads are. Rows with no prompt or no output tokens (failed
requests) cannot be replayed; they are counted and left out, and the caller says how many.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from .azure import Row, compressed
from .inputs import SimInputError
from .prefixes import DEFAULT_SHARE, LOOKBACK_S, block_hashes
from .trace_rows import CsvFormat, RowTrace, TraceWindow, csv_header, read_csv_trace

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def is_azure_csv(path: str | Path) -> bool:
    """Whether the file's first line is an Azure trace header (its three columns, in any order)."""
    return set(COLUMNS) <= csv_header(path)


# ``2023-11-16 18:17:03.9799600`` (2023: no zone, 7 fractional digits) and
# ``2024-05-10 00:00:00.009930+00:00`` (2024: a UTC offset, 6 digits, no fraction on a whole second).
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?")


@lru_cache(maxsize=4096)
def _epoch_seconds(whole: str) -> int:
    return int(datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp())


def _ticks(stamp: str) -> int:
    """An Azure timestamp -> 100 ns ticks since the epoch (UTC), exactly: ``datetime`` takes 6 fractional
    digits and a float of seconds would round Azure's 7."""
    m = _STAMP.fullmatch(stamp.strip())
    if m is None:
        raise ValueError(f"not a timestamp: {stamp!r}")
    whole, frac, zone = m.groups()
    seconds = _epoch_seconds(whole)
    if zone and zone != "Z":
        digits = zone[1:].replace(":", "")
        offset = int(digits[:2]) * 3600 + int(digits[2:]) * 60
        seconds -= offset if zone[0] == "+" else -offset
    return seconds * 10_000_000 + int((frac or "0")[:7].ljust(7, "0"))


AZURE = CsvFormat("Azure", COLUMNS, ticks_per_ms=10_000, tick=_ticks)


def read_azure_csv(
    path: str | Path, window: TraceWindow | None = None, progress: Callable[[int], None] | None = None
) -> RowTrace:
    """The Azure CSV's requests (within ``window``) in arrival order (``trace_rows.read_csv_trace``)."""
    return read_csv_trace(path, AZURE, window, progress)


def mooncake_requests(
    rows: list[Row], share: float = DEFAULT_SHARE, seed: int = 0, lookback_s: float = LOOKBACK_S
) -> list[dict[str, Any]]:
    """Rows (arrival ms, prompt, output tokens) as Mooncake requests, ``share`` of them continuing an earlier
    request within ``lookback_s`` (``prefixes.block_hashes``): how every Azure trace here is replayed."""
    hashes = block_hashes(rows, share, seed, lookback_s=lookback_s)
    return [
        {"timestamp": t, "input_length": isl, "output_length": osl, "hash_ids": ids}
        for (t, isl, osl), ids in zip(rows, hashes, strict=True)
    ]


def write_mooncake(
    trace: RowTrace, out: str | Path, share: float = DEFAULT_SHARE, seed: int = 0, speedup: float = 1.0
) -> Path:
    """The trace ``speedup`` times faster as Mooncake JSON lines at ``out``, ``share`` of its requests
    continuing an earlier one within the lookback compressed with it (as the Azure workloads are made)."""
    if not 0.0 <= share <= 1.0:
        raise SimInputError(f"prefix-share: must be within [0, 1], got {share:g}")
    rows = compressed(tuple(trace.rows), speedup)
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("w", encoding="utf-8") as f:
        f.writelines(
            json.dumps(r, separators=(",", ":")) + "\n"
            for r in mooncake_requests(rows, share, seed, LOOKBACK_S / speedup)
        )
    return dest
