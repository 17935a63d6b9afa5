"""Traces in BurstGPT's format (``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``).

BurstGPT (Wang et al., "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems", KDD 2025;
CC-BY 4.0) logs an Azure OpenAI GPT service's requests over months: arrivals in seconds from the trace's
start, and lengths. Like an Azure trace it carries no prompts, so it is replayed the same way: the prefix
sharing modelled on top (``azure_csv.write_mooncake``). Failed requests (no response tokens) are counted and
left out; a ``--trace-window`` picks the hours to replay.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .trace_rows import CsvFormat, RowTrace, TraceWindow, csv_header, read_csv_trace

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def _micros(stamp: str) -> int:
    """Seconds from the trace's start (``5``, ``5.25``) -> whole microseconds, exactly."""
    try:
        value = Decimal(stamp.strip())
    except InvalidOperation:
        raise ValueError(f"not a number of seconds: {stamp!r}") from None
    if not value.is_finite():
        raise ValueError(f"not a number of seconds: {stamp!r}")
    return int((value * 1_000_000).to_integral_value())


BURSTGPT = CsvFormat("BurstGPT", COLUMNS, ticks_per_ms=1_000, tick=_micros)


def is_burstgpt_csv(path: str | Path) -> bool:
    """Whether the file's first line is a BurstGPT header (its arrival and token columns, in any order)."""
    return set(COLUMNS) <= csv_header(path)


def read_burstgpt_csv(
    path: str | Path, window: TraceWindow | None = None, progress: Callable[[int], None] | None = None
) -> RowTrace:
    """The BurstGPT CSV's requests (within ``window``) in arrival order (``trace_rows.read_csv_trace``)."""
    return read_csv_trace(path, BURSTGPT, window, progress)
