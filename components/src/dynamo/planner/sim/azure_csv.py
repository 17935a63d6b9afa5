"""Traces in the Azure LLM inference format (``TIMESTAMP,ContextTokens,GeneratedTokens``), made replayable.

Azure's public traces (2023's coding and conversation hours, 2024's weeks) carry arrivals and lengths only.
``simulate --trace`` and ``bench_planner_traffic.py --trace`` take such a CSV as it is: its rows become a
Mooncake trace with the prefix sharing modelled on top (``prefixes.block_hashes``: a seeded share of requests
continue an earlier one), as the shipped Azure workloads are. Rows with no prompt or no output tokens (failed
requests) cannot be replayed; they are counted and left out, and the caller says how many.
"""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from .azure import Row
from .inputs import SimInputError
from .prefixes import DEFAULT_SHARE, LOOKBACK_S, block_hashes

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class AzureTrace(NamedTuple):
    rows: list[Row]  # (arrival ms after the first request, prompt tokens, output tokens), by arrival
    skipped: int  # rows left out: no prompt or no output tokens


def is_azure_csv(path: str | Path) -> bool:
    """Whether the file's first line is an Azure trace header (its three columns, in any order)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            header = next(csv.reader([f.readline()]), [])
    except (OSError, UnicodeDecodeError):
        return False
    return set(COLUMNS) <= {h.strip() for h in header}


def _ticks(stamp: str) -> int:
    """``2023-11-16 18:17:03.9799600`` -> 100 ns ticks since the epoch, exactly (Azure writes 7 fractional
    digits; ``datetime`` takes 6, and a float of seconds would round them)."""
    whole, _, frac = stamp.strip().partition(".")
    if not frac.isdigit() and frac:
        raise ValueError(f"bad fraction of a second in {stamp!r}")
    seconds = int(datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp())
    return seconds * 10_000_000 + int((frac or "0")[:7].ljust(7, "0"))


def read_azure_csv(path: str | Path) -> AzureTrace:
    """The CSV's requests in arrival order; SimInputError naming the line for anything unreadable."""
    p = Path(path)
    if not p.is_file():
        raise SimInputError(f"trace {path}: no such file")
    raw: list[tuple[int, int, int]] = []
    skipped = 0
    try:
        with p.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            reader.fieldnames = [h.strip() for h in reader.fieldnames or []]  # as ``is_azure_csv`` reads them
            missing = [c for c in COLUMNS if c not in reader.fieldnames]
            if missing:
                raise SimInputError(f"trace {path}: not an Azure trace (no column {missing[0]})")
            for n, rec in enumerate(reader, start=2):
                try:
                    t = _ticks(rec["TIMESTAMP"])
                    isl, osl = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
                except (TypeError, ValueError) as exc:
                    raise SimInputError(f"trace {path} line {n}: {exc}") from None
                if isl <= 0 or osl <= 0:
                    skipped += 1
                    continue
                raw.append((t, isl, osl))
    except UnicodeDecodeError as exc:
        raise SimInputError(f"trace {path}: not UTF-8 text ({exc.reason})") from None
    if not raw:
        raise SimInputError(f"trace {path}: no requests with prompt and output tokens")
    raw.sort(key=lambda r: r[0])
    first = raw[0][0]
    # Whole milliseconds (half to even), as the shipped traces were derived: the 2023 hours convert to them.
    rows = [(float(round((t - first) / 10_000)), isl, osl) for t, isl, osl in raw]
    return AzureTrace(rows, skipped)


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


def write_mooncake(trace: AzureTrace, out: str | Path, share: float = DEFAULT_SHARE, seed: int = 0) -> Path:
    """The trace as Mooncake JSON lines at ``out``, ``share`` of its requests continuing an earlier one."""
    if not 0.0 <= share <= 1.0:
        raise SimInputError(f"prefix-share: must be within [0, 1], got {share:g}")
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("w", encoding="utf-8") as f:
        f.writelines(
            json.dumps(r, separators=(",", ":")) + "\n" for r in mooncake_requests(trace.rows, share, seed)
        )
    return dest


def convert_azure_csv(path: str | Path, out: str | Path, share: float = DEFAULT_SHARE, seed: int = 0) -> str:
    """Write the Azure-format CSV at ``path`` as a Mooncake trace at ``out``; returns the line a command
    prints about it (requests kept, rows left out, the modelled sharing)."""
    trace = read_azure_csv(path)
    write_mooncake(trace, out, share, seed)
    left_out = f", {trace.skipped} rows without prompt or output tokens left out" if trace.skipped else ""
    return (
        f"{path}: Azure format, {len(trace.rows)} requests{left_out}; {share:g} of them continue an earlier "
        f"one (seed {seed})"
    )
