"""The two public Azure LLM inference traces (2023) shipped with the package, as (offset_ms, isl, osl) rows.

``traces/azure_{code,conv}.csv.gz``: one hour each of a coding and a conversation service (CC-BY 4.0; license
and attribution in ``traces/README.md``). The traces carry arrival times and lengths only: prefix sharing is
modelled on top (``prefixes.py``).
"""

from __future__ import annotations

import csv
import gzip
import io
from functools import cache
from importlib import resources

AZURE_TRACES = ("code", "conv")

Row = tuple[float, int, int]  # arrival in ms after the first request, prompt tokens, output tokens


@cache
def azure_rows(name: str) -> tuple[Row, ...]:
    """Every request of trace ``name`` ("code" or "conv") in arrival order."""
    if name not in AZURE_TRACES:
        raise ValueError(f"unknown Azure trace {name!r}; known: {', '.join(AZURE_TRACES)}")
    raw = resources.files(__package__).joinpath("traces", f"azure_{name}.csv.gz").read_bytes()
    text = gzip.decompress(raw).decode("utf-8")
    reader = csv.DictReader(io.StringIO(text))
    return tuple((float(r["offset_ms"]), int(r["isl"]), int(r["osl"])) for r in reader)


def compressed(rows: tuple[Row, ...], speedup: float, window_s: float | None = None) -> list[Row]:
    """The rows ``speedup`` times faster (x2: the same requests in half the time), cut to the first
    ``window_s`` seconds of the compressed trace (None: all of it)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup:g}")
    out = [(round(t / speedup, 3), isl, osl) for t, isl, osl in rows]
    if window_s is not None:
        out = [r for r in out if r[0] < window_s * 1000.0]
    return out
