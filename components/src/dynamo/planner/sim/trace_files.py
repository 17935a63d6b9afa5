"""A ``--trace`` file made replayable, whatever its format: a part of it cut, its arrivals sped up.

``simulate --trace`` and ``bench_planner_traffic.py --trace`` take three formats, told apart by their first
line: Azure's CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``: the 2023 hours, the 2024 weeks), BurstGPT's
CSV (``Timestamp,...,Request tokens,Response tokens,...``) and Mooncake JSON lines (arrivals, lengths and
hash ids). A CSV carries no prompts: it becomes a Mooncake trace with the prefix sharing modelled, as the
shipped Azure workloads are (64 tokens per hash id). A Mooncake trace keeps its ids; how many prompt
tokens one id stands for is read from the trace itself when not given (Mooncake's published traces hash
512-token blocks, the traces written here 64), since the simulator would otherwise count a shared id as the
wrong number of cached tokens. ``--trace-window START:LENGTH`` replays a part of a long trace,
``--trace-speedup F`` the trace F times faster (x2: the same requests in half the time), as the
``azure-*-x2`` workloads are made.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .azure_csv import is_azure_csv, read_azure_csv, write_mooncake
from .burstgpt_csv import is_burstgpt_csv, read_burstgpt_csv
from .inputs import SimInputError, check_trace
from .prefixes import BLOCK_TOKENS, DEFAULT_SHARE
from .trace_rows import TraceWindow

TraceKind = Literal["Azure", "BurstGPT", "Mooncake"]
BLOCK_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024)  # prompt tokens per hash id that a trace may use
# Above this many requests a replay takes minutes per run (the Azure conversation hour's 19,366: about 16 s).
LONG_REPLAY = 200_000


@dataclass(frozen=True, slots=True)
class TraceOptions:
    window: TraceWindow | None = None
    speedup: float = 1.0
    share: float = DEFAULT_SHARE  # a CSV trace's modelled prefix sharing
    seed: int = 0  # its seed
    block_size: int | None = None  # a Mooncake trace's tokens per hash id; None: read from the trace
    max_requests: int | None = None  # refuse a trace of more requests (None: any)


@dataclass(frozen=True, slots=True)
class Prepared:
    path: Path  # the Mooncake trace to replay: the file itself, or one written at ``out``
    kind: TraceKind
    block_size: int  # prompt tokens per hash id
    requests: int
    note: str  # what a command prints about it


def trace_kind(path: str | Path) -> TraceKind:
    if is_azure_csv(path):
        return "Azure"
    if is_burstgpt_csv(path):
        return "BurstGPT"
    return "Mooncake"


def load_mooncake(path: str | Path) -> list[Any]:
    """Every request of a Mooncake trace, parsed once for everything ``prepare_trace`` reads of it; a file
    that is not JSON lines gets ``check_trace``'s error, which names the line."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        check_trace(str(path))
        raise SimInputError(f"trace {path}: not JSON lines") from None


def infer_block_size(requests: Iterable[Any]) -> int | None:
    """The tokens per hash id that every request of a Mooncake trace agrees with (``len(hash_ids) ==
    ceil(input_length / size)``): 64 when it is among them, else the smallest; None when no size fits every
    request or no request has ids (a malformed request is left to ``check_trace``)."""
    fits: set[int] | None = None
    for obj in requests:
        try:
            ids, isl = obj.get("hash_ids"), int(obj["input_length"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if not isinstance(ids, list) or not ids or isl <= 0:
            continue
        here = {b for b in BLOCK_CANDIDATES if len(ids) == math.ceil(isl / b)}
        fits = here if fits is None else fits & here
        if not fits:
            return None
    if not fits:
        return None
    return BLOCK_TOKENS if BLOCK_TOKENS in fits else min(fits)


class _Rewritten(NamedTuple):
    requests: int  # kept
    outside: int  # outside the window
    given_ids: int  # requests that had no hash ids and were given their own


def _rewrite_mooncake(
    path: str | Path,
    requests: list[dict[str, Any]],
    out: Path,
    window: TraceWindow | None,
    speedup: float,
    block: int,
) -> _Rewritten:
    """The checked Mooncake trace's ``requests`` (parsed from ``path``, which errors name) within
    ``window``, ``speedup`` times faster, from the first one kept, written at ``out``. Hash ids are kept;
    a request without them (the format allows it, the simulator does not) gets ids of its own, shared
    with no other request."""
    first = min(float(r["timestamp"]) for r in requests)
    lo, hi = first, math.inf
    if window is not None:
        lo = first + window.start_s * 1000.0
        hi = lo + window.length_s * 1000.0 if window.length_s is not None else math.inf
    kept = [r for r in requests if lo <= float(r["timestamp"]) < hi]
    kept.sort(key=lambda r: float(r["timestamp"]))
    if not kept:
        assert window is not None
        raise SimInputError(f"trace {path}: no requests in the {window.describe()}")
    base = float(kept[0]["timestamp"])
    fresh = 1 + max((i for r in requests for i in r.get("hash_ids") or ()), default=-1)
    given = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in kept:
            r["timestamp"] = round((float(r["timestamp"]) - base) / speedup, 3)
            if not r.get("hash_ids"):
                n = math.ceil(int(r["input_length"]) / block)
                r["hash_ids"], fresh, given = list(range(fresh, fresh + n)), fresh + n, given + 1
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return _Rewritten(len(kept), len(requests) - len(kept), given)


def prepare_trace(
    path: str | Path,
    out: str | Path,
    opts: TraceOptions = TraceOptions(),
    progress: Callable[[int], None] | None = None,
) -> Prepared:
    """``path`` as a Mooncake trace to replay (written at ``out`` when anything had to change), checked;
    SimInputError with one line for anything that cannot be replayed. ``progress`` is called with the rows
    read, every million, while a CSV is read."""
    if not opts.speedup > 0 or not math.isfinite(opts.speedup):
        raise SimInputError(f"trace-speedup: must be a number above 0, got {opts.speedup:g}")
    dest, kind = Path(out), trace_kind(path)
    cut = f", {opts.window.describe()}" if opts.window is not None else ""
    faster = f", {opts.speedup:g}x faster" if opts.speedup != 1 else ""
    if kind != "Mooncake":
        if opts.block_size is not None and opts.block_size != BLOCK_TOKENS:
            raise SimInputError(
                f"trace-block-size: a CSV trace (Azure, BurstGPT) is converted with {BLOCK_TOKENS}-token "
                "blocks"
            )
        read = read_azure_csv if kind == "Azure" else read_burstgpt_csv
        trace = read(path, opts.window, progress)
        _refuse_above(path, len(trace.rows), opts.max_requests)
        write_mooncake(trace, dest, opts.share, opts.seed, opts.speedup)
        left_out = f", {trace.skipped} rows without prompt or output tokens left out" if trace.skipped else ""
        beyond = f" ({trace.outside} requests outside it)" if opts.window is not None else ""
        note = (
            f"{path}: {kind} format, {len(trace.rows)} requests{left_out}{cut}{beyond}{faster}; "
            f"{opts.share:g} of them continue an earlier one (seed {opts.seed})"
        )
        return Prepared(dest, kind, BLOCK_TOKENS, len(trace.rows), note + _long(len(trace.rows), opts))
    loaded = load_mooncake(path)
    how = "given"
    block = opts.block_size
    if block is None:
        block = infer_block_size(loaded)
        how = "read from the trace" if block is not None else "default"
        block = BLOCK_TOKENS if block is None else block
    check_trace(str(path), block)
    _refuse_above(path, len(loaded), opts.max_requests)
    replayed, requests, outside, own = Path(path), len(loaded), 0, ""
    if opts.window is not None or opts.speedup != 1 or any(not r.get("hash_ids") for r in loaded):
        replayed = dest
        requests, outside, given = _rewrite_mooncake(path, loaded, dest, opts.window, opts.speedup, block)
        own = f"; {given} requests without hash_ids given their own (no sharing)" if given else ""
    beyond = f" ({outside} requests outside it)" if opts.window is not None else ""
    note = (
        f"{path}: Mooncake format, {requests} requests{cut}{beyond}{faster}; each hash id stands for "
        f"{block} prompt tokens ({how}; --trace-block-size sets it){own}"
    )
    return Prepared(replayed, "Mooncake", block, requests, note + _long(requests, opts))


def _refuse_above(path: str | Path, requests: int, most: int | None) -> None:
    if most is not None and requests > most:
        raise SimInputError(
            f"trace {path}: {requests} requests, more than {most} to replay in every run (the Azure "
            f"conversation hour's 19,366 take about 16 s a run); --trace-window START:LENGTH picks the part "
            f"to judge (2h:1h: the third hour), --trace-window 0: all of it"
        )


def _long(requests: int, opts: TraceOptions) -> str:
    if requests <= LONG_REPLAY:
        return ""
    return (
        f"; replaying {requests} requests takes minutes per run (the Azure conversation hour's 19,366: about "
        f"16 s); --trace-window START:LENGTH replays a part"
    )
