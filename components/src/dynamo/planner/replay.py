"""Replay a recorded FPM stream through the policy offline, to tune thresholds on real traffic.

Input: the JSON lines of ``python -m dynamo.common.recv_forward_pass_metrics --json`` (one object per
record: ``subject``, ``component``, ``endpoint``, the envelope's ``published_at_ms`` and every FPM field
nested as in the schema). The record time is the first of ``received_at`` (epoch s),
``received_at_ms``, ``published_at_ms`` present; lines without any are spaced by ``--step``.
The stream does not react to decisions, so replicas are the workers seen and no action is waited
for (as with ``--dry-run``); everything else -- windows, consolidation, budget, staleness, warm-up --
is the live policy's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec
from dynamo.common.forward_pass_metrics import FPM_VERSION, ForwardPassMetrics
from dynamo.common.fpm_subjects import parse_fpm_subject

from .config import PlannerConfig
from .decision_log import lines as decision_lines
from .observations import WorkerBook
from .policy import Decision, PolicyState, decide, settle


@dataclass
class ReplayResult:
    decisions: list[Decision] = field(default_factory=list)
    records: int = 0
    bad_lines: int = 0
    other_components: int = 0
    start: float = 0.0


def _time(obj: dict[str, Any]) -> float | None:
    for key, scale in (("received_at", 1.0), ("received_at_ms", 1e-3), ("published_at_ms", 1e-3)):
        v = obj.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v) * scale
    return None


def parse_line(line: str) -> tuple[str, str, ForwardPassMetrics, float | None] | None:
    """(component, endpoint, record, time) of one JSON line, or None if it is not a record."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return parse_object(obj) if isinstance(obj, dict) else None


def parse_object(obj: dict[str, Any]) -> tuple[str, str, ForwardPassMetrics, float | None] | None:
    """(component, endpoint, record, time) of one decoded ``--json`` object, or None if it is not a record.

    The one reader of the watch CLI's JSON lines: the replay and the demo's live view use it.
    """
    comp, ep = obj.get("component"), obj.get("endpoint")
    if (not isinstance(comp, str) or not isinstance(ep, str)) and isinstance(obj.get("subject"), str):
        parsed = parse_fpm_subject(obj["subject"])
        if parsed is not None:
            comp, ep = parsed.component, parsed.endpoint
    if not isinstance(comp, str) or not isinstance(ep, str):
        return None
    fields = {k: v for k, v in obj.items() if k in ForwardPassMetrics.__struct_fields__}
    try:
        record = msgspec.convert(fields, ForwardPassMetrics)
    except msgspec.ValidationError:
        return None
    if record.version != FPM_VERSION:
        return None
    return comp, ep, record, _time(obj)


def replay(
    stream: Iterable[str], cfg: PlannerConfig, *, step: float = 0.1
) -> Iterator[tuple[Decision, dict[str, Any]]]:
    """Yield (decision, extra) every ``interval_s`` of stream time; ``extra`` has counters."""
    book = WorkerBook(cfg)
    state = PolicyState()
    t0: float | None = None
    last_t = 0.0
    next_tick: float | None = None
    counts = {"records": 0, "bad_lines": 0, "other": 0}

    def tick(at: float) -> Decision:
        nonlocal state
        d, state = decide(book.observe(at), state, cfg)
        state = settle(state, dry_run=True)  # the stream does not react: wait for nothing
        return d

    for i, line in enumerate(stream):
        if not line.strip():
            continue
        parsed = parse_line(line)
        if parsed is None:
            counts["bad_lines"] += 1
            continue
        comp, ep, record, t = parsed
        t = last_t + step if t is None else t
        if t0 is None:
            t0 = t
            next_tick = t0 + cfg.interval_s
        t = max(t, last_t)  # out-of-order lines: never go back in time
        while next_tick is not None and t >= next_tick:
            yield tick(next_tick - t0), dict(counts, t0=t0)
            next_tick += cfg.interval_s
        last_t = t
        pool = book.pool_of(comp)
        if pool is None or ep != cfg.endpoint:
            counts["other"] += 1
            continue
        book.ingest(pool, record, t - t0)
        counts["records"] += 1
        del i
    if t0 is not None and next_tick is not None:
        yield tick(next_tick - t0), dict(counts, t0=t0)


def timeline_header() -> str:
    return f"{'t(s)':>8}  {'prefill':>11} {'load':>6}  {'decode':>11} {'load':>6}  decision"


def timeline_row(d: Decision) -> str:
    cells = []
    for p in ("prefill", "decode"):
        pd = d.pool(p)
        mx = "-" if pd.load_max is None else f"{pd.load_max:.2f}"
        cells.append(f"{pd.current:>4} -> {pd.desired:<3} {mx:>6}")
    notes = "; ".join(
        f"{p} {d.pool(p).action}: {d.pool(p).reason}"
        for p in ("prefill", "decode")
        if d.pool(p).action != "hold"
    )
    return f"{d.now:>8.1f}  {cells[0]}  {cells[1]}  {notes or 'hold'}"


def run_replay(
    stream: Iterable[str], cfg: PlannerConfig, out: TextIO, *, as_json: bool = False, step: float = 0.1
) -> ReplayResult:
    result = ReplayResult()
    if not as_json:
        out.write(timeline_header() + "\n")
    counts: dict[str, Any] = {}
    for n, (d, counts) in enumerate(replay(stream, cfg, step=step), start=1):
        result.decisions.append(d)
        if as_json:
            for line in decision_lines(d, ts=counts["t0"] + d.now, tick=n, applied={}, dry_run=True):
                out.write(line + "\n")
        else:
            out.write(timeline_row(d) + "\n")
    result.records = counts.get("records", 0)
    result.bad_lines = counts.get("bad_lines", 0)
    result.other_components = counts.get("other", 0)
    if not as_json:
        actions = [(p, d.pool(p).action) for d in result.decisions for p in ("prefill", "decode")]
        ups = {p: sum(1 for q, a in actions if q == p and a == "scale_up") for p in ("prefill", "decode")}
        downs = {p: sum(1 for q, a in actions if q == p and a == "scale_down") for p in ("prefill", "decode")}
        out.write(
            f"\n{len(result.decisions)} decisions from {result.records} records "
            f"({result.bad_lines} unreadable lines, {result.other_components} of other components); "
            f"prefill +{ups['prefill']}/-{downs['prefill']}, decode +{ups['decode']}/-{downs['decode']}\n"
        )
    return result
