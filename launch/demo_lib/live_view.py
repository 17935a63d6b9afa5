"""The live terminal view: one screen rendered from the load state and the recorded signals (pure)."""

from __future__ import annotations

import time

from dynamo.planner.decision_log import DecisionEntry

from .load import LoadState
from .signals import FpmSample


def progress_bar(fraction: float, width: int = 30) -> str:
    fraction = max(0.0, min(1.0, fraction))
    filled = round(fraction * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction * 100:5.1f}%"


def _kv(v: float | None) -> str:
    return "   n/a" if v is None else f"{v:6.0f}"


def engine_rows(engines: list[FpmSample]) -> list[str]:
    head = (
        f"{'pool':<8}{'worker':<22}{'q.prefill tok':>14}{'q.decode req':>13}"
        f"{'KV in-flight':>13}{'KV ready':>9}{'run.decode':>11}{'step ms':>8}"
    )
    rows = [head]
    for s in engines:
        worker = s.worker if len(s.worker) <= 20 else s.worker[:9] + ".." + s.worker[-9:]
        rows.append(
            f"{s.pool:<8}{worker:<22}{s.queued_prefill_tokens:>14.0f}{s.queued_decode_requests:>13.0f}"
            f"{_kv(s.kv_transfer_tokens):>13}{_kv(s.kv_ready_tokens):>9}{s.scheduled_decode_requests:>11.0f}"
            f"{s.wall_time * 1000:>8.1f}"
        )
    if not engines:
        rows.append("  (no FPM records yet)")
    return rows


def decision_rows(decisions: list[DecisionEntry], t0: float, limit: int = 8) -> list[str]:
    """The latest decisions, actions marked with '>>' and holds shown once per reason run."""
    rows: list[str] = []
    shown: list[DecisionEntry] = []
    for d in decisions:
        if shown and not d.is_action and not shown[-1].is_action:
            prev = shown[-1]
            if prev.pool == d.pool and prev.reason == d.reason:
                shown[-1] = d
                continue
        shown.append(d)
    for d in shown[-limit:]:
        mark = ">>" if d.is_action else "  "
        rows.append(f"{mark} +{d.ts - t0:6.1f}s {d.pool:<8}{d.current} -> {d.desired}  {d.reason[:70]}")
    return rows or ["  (no planner decisions yet)"]


def render(
    load: LoadState,
    engines: list[FpmSample],
    decisions: list[DecisionEntry],
    replicas: dict[str, int | None],
    t0: float,
    title: str = "dynamo-fpm demo",
    now: float | None = None,
    notes: list[str] | None = None,
    connector: dict[str, dict[str, int] | None] | None = None,
) -> str:
    """The whole screen as text (the caller clears the terminal and prints it).

    ``replicas``: the planner's desired count per pool; ``connector``: the local connector's latest counts
    per pool (starting, standby, ...), shown next to it.
    """
    now = now if now is not None else time.time()
    lines = [
        f"{title}   t=+{now - t0:6.1f}s",
        f"load  {progress_bar(load.progress(now))}  phase: {load.phase or '-'}",
        f"      in flight {load.in_flight:3d}   done {load.done:5d}   failed {load.failed:4d}"
        + (f"   last error: {load.last_error[:60]}" if load.last_error else ""),
        "replicas  " + "   ".join(f"{p}: {'?' if n is None else n}" for p, n in replicas.items()),
        *(
            [f"          planner's workers: {connector_line(connector or {})}"]
            if connector_line(connector or {})
            else []
        ),
        "",
        *engine_rows(engines),
        "",
        "planner decisions (>> = scaling action):",
        *decision_rows(decisions, t0),
    ]
    for note in notes or []:
        lines.append(note)
    return "\n".join(lines)


def connector_line(connector: dict[str, dict[str, int] | None]) -> str:
    """``decode 1 starting, 1 standby`` from the connector's counts ("" when it has none)."""
    parts = []
    for pool, c in connector.items():
        if not c:
            continue
        labels = (
            ("starting", "starting"),
            ("standby", "standby (warm)"),
            ("standby_loading", "standby loading"),
            ("draining", "draining"),
        )
        items = [f"{c.get(k, 0)} {label}" for k, label in labels if c.get(k)]
        parts.append(f"{pool}: " + (", ".join(items) if items else "all serving"))
    return "   ".join(parts)


CLEAR = "\x1b[H\x1b[2J"


def compact_status(
    load: LoadState, replicas: dict[str, int | None], engines: list[FpmSample], t0: float
) -> str:
    """One line for non-terminal output (logs, CI)."""
    qd = sum(s.queued_decode_requests for s in engines if s.pool == "decode")
    qp = sum(s.queued_prefill_tokens for s in engines if s.pool == "prefill")
    reps = " ".join(f"{p}={'?' if n is None else n}" for p, n in replicas.items())
    return (
        f"[+{time.time() - t0:6.1f}s] {load.phase or '-':<8} {progress_bar(load.progress(), 20)} "
        f"inflight={load.in_flight} done={load.done} failed={load.failed} "
        f"queued_decode_req={qd:.0f} queued_prefill_tok={qp:.0f} replicas: {reps}"
    )
