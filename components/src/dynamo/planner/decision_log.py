"""Every decision, holds included, as JSON lines: one object per pool per tick.

Fields: ``time`` (UTC ISO-8601), ``ts`` (epoch seconds), ``tick``, ``pool``, ``current``,
``desired``, ``action`` (scale_up | scale_down | hold), ``code`` (the rule that made it), ``reason``,
``signals`` (what the rule used), ``applied`` (sent to the connector), ``dry_run``. :func:`read_entry` /
:func:`parse_entry` read a line back (the demo reads the log through them).

Size limit: a line is at most ``MAX_LINE_CHARS`` (16,384) characters. A longer one has its reason cut to
``MAX_REASON_CHARS`` and every string in ``signals`` to ``MAX_SIGNAL_STR_CHARS`` (the cuts end in
``...[truncated]``), then, if still too long, its signals replaced by ``{"truncated": true}``; such a
line carries ``"truncated": true``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from .policy import Decision, PoolDecision

MAX_LINE_CHARS = 16_384
MAX_REASON_CHARS = 1_000
MAX_SIGNAL_STR_CHARS = 256
MAX_SIGNAL_ITEMS = 64
CUT = "...[truncated]"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - len(CUT))] + CUT


def _shrink(v: Any) -> Any:
    """Strings cut, long lists and mappings shortened (a forged worker id must not fill the log)."""
    if isinstance(v, str):
        return _cut(v, MAX_SIGNAL_STR_CHARS)
    if isinstance(v, dict):
        items = list(v.items())
        out = {_cut(str(k), MAX_SIGNAL_STR_CHARS): _shrink(x) for k, x in items[:MAX_SIGNAL_ITEMS]}
        if len(items) > MAX_SIGNAL_ITEMS:
            out["truncated_items"] = len(items) - MAX_SIGNAL_ITEMS
        return out
    if isinstance(v, list | tuple):
        out_list = [_shrink(x) for x in v[:MAX_SIGNAL_ITEMS]]
        if len(v) > MAX_SIGNAL_ITEMS:
            out_list.append(f"... {len(v) - MAX_SIGNAL_ITEMS} more")
        return out_list
    return v


def _dump(e: dict[str, Any]) -> str:
    return json.dumps(e, separators=(",", ":"), sort_keys=False)


def bounded_line(e: dict[str, Any]) -> str:
    """The entry as one JSON line of at most ``MAX_LINE_CHARS`` characters (see the module doc)."""
    line = _dump(e)
    if len(line) <= MAX_LINE_CHARS:
        return line
    e = dict(e, reason=_cut(str(e.get("reason", "")), MAX_REASON_CHARS), signals=_shrink(e.get("signals")))
    e["truncated"] = True
    line = _dump(e)
    if len(line) <= MAX_LINE_CHARS:
        return line
    e["signals"] = {"truncated": True}
    return _dump(e)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def entry(pd: PoolDecision, *, ts: float, tick: int, applied: bool, dry_run: bool) -> dict[str, Any]:
    return {
        "time": datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds"),
        "ts": round(ts, 3),
        "tick": tick,
        "pool": pd.pool,
        "current": pd.current,
        "desired": pd.desired,
        "action": pd.action,
        "code": pd.code,
        "reason": pd.reason,
        "signals": _clean(pd.signals.as_dict()),
        "applied": applied,
        "dry_run": dry_run,
    }


def lines(decision: Decision, *, ts: float, tick: int, applied: dict[str, bool], dry_run: bool) -> list[str]:
    return [
        bounded_line(
            entry(decision.pool(p), ts=ts, tick=tick, applied=applied.get(p, False), dry_run=dry_run)
        )
        for p in ("prefill", "decode")
    ]


@dataclass(frozen=True)
class DecisionEntry:
    """One decision-log line read back (holds included): the fields :func:`entry` writes."""

    ts: float
    pool: str
    current: int
    desired: int
    reason: str = ""
    action: str = "hold"
    code: str = ""
    tick: int = 0
    applied: bool = False
    dry_run: bool = False
    signals: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_action(self) -> bool:
        """Whether the decision changes the pool's replica count."""
        return self.desired != self.current

    @property
    def direction(self) -> int:
        """+1 scale up, -1 scale down, 0 hold."""
        return (self.desired > self.current) - (self.desired < self.current)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_entry(obj: Mapping[str, Any]) -> DecisionEntry | None:
    """One decoded decision-log object, or None when it is not one (no pool, time or replica counts)."""
    pool, ts = obj.get("pool"), obj.get("ts")
    current, desired = _int(obj.get("current")), _int(obj.get("desired"))
    if pool not in ("prefill", "decode") or current is None or desired is None:
        return None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return None
    signals = obj.get("signals")
    return DecisionEntry(
        ts=float(ts),
        pool=str(pool),
        current=current,
        desired=desired,
        reason=str(obj.get("reason", "")),
        action=str(obj.get("action", "hold")),
        code=str(obj.get("code", "")),
        tick=_int(obj.get("tick")) or 0,
        applied=obj.get("applied") is True,
        dry_run=obj.get("dry_run") is True,
        signals=signals if isinstance(signals, dict) else {},
    )


def read_entry(line: str) -> DecisionEntry | None:
    """One decision-log line, or None when it is not valid JSON or not an entry."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return parse_entry(obj) if isinstance(obj, dict) else None


class DecisionLog:
    """Appends to a file (``--decision-log``) and/or writes to stdout (``--json``), flushed per line."""

    def __init__(
        self, path: str | Path | None = None, *, stdout: bool = False, stream: TextIO | None = None
    ) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._stream = stream if stream is not None else (sys.stdout if stdout else None)

    def write(self, text_lines: list[str]) -> None:
        for out in (self._file, self._stream):
            if out is not None:
                for line in text_lines:
                    out.write(line + "\n")
                out.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
