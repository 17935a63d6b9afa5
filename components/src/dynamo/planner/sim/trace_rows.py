"""A CSV trace's requests read as rows, and a part of a long trace (``--trace-window START:LENGTH``).

The public week-long traces (Azure 2024, BurstGPT) hold millions of requests: replaying a whole week takes
hours per run, and a planner is judged on an hour or two of it. A window is given in the trace's own time,
from its first request, before any speed-up: ``2h:1h`` is the third hour. Arrivals are kept as integers in
the file's own unit (``array``s, 8 bytes each) until the window is cut: tens of millions of rows fit.
"""

from __future__ import annotations

import csv
import math
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .azure import Row
from .inputs import SimInputError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*")
PROGRESS_ROWS = 1_000_000  # a long read reports every this many rows


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """Seconds from the trace's first request: where the part starts, how long it is (None: to the end)."""

    start_s: float = 0.0
    length_s: float | None = None

    def describe(self) -> str:
        length = " to the end" if self.length_s is None else f" for {_short(self.length_s)}"
        return f"window from {_short(self.start_s)}{length}"


def _short(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def parse_duration(text: str, what: str) -> float:
    """``90``, ``90s``, ``1.5m``, ``2h``, ``1d`` -> seconds; SimInputError naming ``what`` otherwise."""
    m = _DURATION.fullmatch(text)
    if m is None:
        raise SimInputError(f"{what}: {text!r} is not a duration (a number with s, m, h or d: 90s, 2h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_window(text: str) -> TraceWindow:
    """``START:LENGTH`` (``2h:1h``), ``START:`` (START to the end) or ``LENGTH`` alone (from the start)."""
    what = "trace-window"
    if not text.strip():
        raise SimInputError(f"{what}: empty; START:LENGTH, as 2h:1h")
    start_text, sep, length_text = text.partition(":")
    if not sep:
        start_text, length_text = "0", text
    start = parse_duration(start_text, what)
    length = parse_duration(length_text, what) if length_text.strip() else None
    if length is not None and length <= 0:
        raise SimInputError(f"{what}: the length must be above 0, got {text!r}")
    return TraceWindow(start, length)


class Collected(NamedTuple):
    rows: list[Row]  # (ms after the first request kept, prompt tokens, output tokens), by arrival
    outside: int  # requests before or after the window


class Arrivals:
    """A trace's requests as read: arrivals in the file's unit (``ticks_per_ms`` to the ms), lengths."""

    def __init__(self, ticks_per_ms: int) -> None:
        self.ticks_per_ms = ticks_per_ms
        self.ticks = array("q")
        self.isl = array("q")
        self.osl = array("q")

    def add(self, tick: int, isl: int, osl: int) -> None:
        self.ticks.append(tick)
        self.isl.append(isl)
        self.osl.append(osl)

    def __len__(self) -> int:
        return len(self.ticks)

    def collect(self, window: TraceWindow | None = None) -> Collected:
        """The requests within ``window`` (all without one) in arrival order (ties in file order), as rows
        in whole milliseconds (half to even) after the first request kept."""
        ticks, tpm = self.ticks, self.ticks_per_ms
        if not ticks:
            return Collected([], 0)
        first = min(ticks)
        lo, hi = first, math.inf
        if window is not None:
            lo = first + round(window.start_s * 1000 * tpm)
            if window.length_s is not None:
                hi = lo + round(window.length_s * 1000 * tpm)
        kept = [i for i, t in enumerate(ticks) if lo <= t < hi]
        kept.sort(key=ticks.__getitem__)
        if not kept:
            return Collected([], len(ticks))
        base = ticks[kept[0]]
        rows = [(float(round((ticks[i] - base) / tpm)), self.isl[i], self.osl[i]) for i in kept]
        return Collected(rows, len(ticks) - len(kept))


class RowTrace(NamedTuple):
    rows: list[Row]  # (arrival ms after the first request kept, prompt tokens, output tokens), by arrival
    skipped: int  # rows left out: no prompt or no output tokens (failed requests)
    outside: int = 0  # requests outside the window asked for


@dataclass(frozen=True, slots=True)
class CsvFormat:
    """A CSV trace format: its name, the columns of arrival, prompt and output tokens, and how an arrival
    reads as an integer tick (``ticks_per_ms`` of them to the millisecond)."""

    name: str
    columns: tuple[str, str, str]
    ticks_per_ms: int
    tick: Callable[[str], int]


def csv_header(path: str | Path) -> set[str]:
    """The names in a CSV file's first line, stripped; empty for a file that cannot be read as text."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return {h.strip() for h in next(csv.reader([f.readline()]), [])}
    except (OSError, UnicodeDecodeError):
        return set()


def read_csv_trace(
    path: str | Path,
    fmt: CsvFormat,
    window: TraceWindow | None = None,
    progress: Callable[[int], None] | None = None,
) -> RowTrace:
    """The file's requests (within ``window``) in arrival order; SimInputError naming the line for anything
    unreadable. Rows with no prompt or no output tokens are counted and left out. ``progress`` is called with
    the rows read every ``PROGRESS_ROWS``."""
    p = Path(path)
    if not p.is_file():
        raise SimInputError(f"trace {path}: no such file")
    arrivals = Arrivals(fmt.ticks_per_ms)
    skipped = 0
    try:
        with p.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]  # as ``csv_header`` reads them
            missing = [c for c in fmt.columns if c not in header]
            if missing:
                raise SimInputError(f"trace {path}: not an {fmt.name} trace (no column {missing[0]})")
            at, ai, ao = (header.index(c) for c in fmt.columns)
            for n, rec in enumerate(reader, start=2):
                if not rec:
                    continue
                try:
                    t = fmt.tick(rec[at])
                    isl, osl = int(rec[ai]), int(rec[ao])
                except (IndexError, ValueError) as exc:
                    raise SimInputError(f"trace {path} line {n}: {exc}") from None
                if isl <= 0 or osl <= 0:
                    skipped += 1
                    continue
                arrivals.add(t, isl, osl)
                if progress is not None and n % PROGRESS_ROWS == 0:
                    progress(n)
    except UnicodeDecodeError as exc:
        raise SimInputError(f"trace {path}: not UTF-8 text ({exc.reason})") from None
    if not len(arrivals):
        raise SimInputError(f"trace {path}: no requests with prompt and output tokens")
    rows, outside = arrivals.collect(window)
    if not rows:
        assert window is not None
        raise SimInputError(f"trace {path}: no requests in the {window.describe()}")
    return RowTrace(rows, skipped, outside)
