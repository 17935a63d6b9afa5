"""Every decision, holds included, as JSON lines: one object per pool per tick.

Fields: ``time`` (UTC ISO-8601), ``ts`` (epoch seconds), ``tick``, ``pool``, ``current``,
``desired``, ``action`` (scale_up | scale_down | hold), ``reason``, ``signals`` (what the rule used),
``applied`` (sent to the connector), ``dry_run``.
"""

from __future__ import annotations

import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from .policy import Decision, PoolDecision


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
        "reason": pd.reason,
        "signals": _clean(pd.signals),
        "applied": applied,
        "dry_run": dry_run,
    }


def lines(decision: Decision, *, ts: float, tick: int, applied: dict[str, bool], dry_run: bool) -> list[str]:
    return [
        json.dumps(
            entry(decision.pool(p), ts=ts, tick=tick, applied=applied.get(p, False), dry_run=dry_run),
            separators=(",", ":"),
            sort_keys=False,
        )
        for p in ("prefill", "decode")
    ]


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
