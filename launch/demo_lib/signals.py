"""Read the JSON-line streams the demo records: FPM records (watch CLI ``--json``), planner decisions, and
the planner's ``local`` connector events (``logs/local-connector-events.jsonl``: workers started, promoted,
serving, parked, stopped, with the per-pool counts after each).

Each line is read through the project's own parser of its format: the planner's replay reader for the watch
CLI's FPM lines (:func:`dynamo.planner.replay.parse_object`), the decision log's reader for decisions
(:func:`dynamo.planner.decision_log.parse_entry`). The files are written by other processes that may be
mid-line: an incomplete line waits for its end, a bad one is counted, never fatal.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.planner.decision_log import DecisionEntry, parse_entry
from dynamo.planner.replay import parse_object as parse_fpm_object

POOL_OF_COMPONENT = {"prefill": "prefill", "backend": "decode", "decode": "decode"}
POOLS = ("prefill", "decode")


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class FpmSample:
    """The per-engine figures the demo shows, from one FPM record."""

    t: float
    pool: str
    worker: str
    dp_rank: int
    wall_time: float
    queued_prefill_tokens: float
    queued_prefill_requests: float
    queued_decode_requests: float
    queued_decode_kv_tokens: float
    kv_transfer_tokens: float | None  # None: producer does not report the split
    kv_ready_tokens: float | None
    kv_transfer_requests: float | None
    kv_ready_requests: float | None
    scheduled_decode_requests: float
    scheduled_decode_kv_tokens: float
    scheduled_prefill_tokens: float

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.pool, self.worker, self.dp_rank)


def _opt(v: int | None) -> float | None:
    return None if v is None else float(v)


def parse_fpm_line(obj: dict[str, Any], now: float | None = None) -> FpmSample | None:
    """One watch-CLI JSON object -> sample; None when it is not an FPM record of a known pool."""
    parsed = parse_fpm_object(obj)
    if parsed is None:
        return None
    component, _endpoint, rec, t = parsed
    pool = POOL_OF_COMPONENT.get(component)
    if pool is None:
        return None
    sched, queued = rec.scheduled_requests, rec.queued_requests
    return FpmSample(
        t=t if t is not None else (now if now is not None else time.time()),
        pool=pool,
        worker=rec.worker_id,
        dp_rank=rec.dp_rank,
        wall_time=rec.wall_time,
        queued_prefill_tokens=float(queued.sum_prefill_tokens),
        queued_prefill_requests=float(queued.num_prefill_requests),
        queued_decode_requests=float(queued.num_decode_requests),
        queued_decode_kv_tokens=float(queued.sum_decode_kv_tokens),
        kv_transfer_tokens=_opt(queued.sum_decode_kv_transfer_tokens),
        kv_ready_tokens=_opt(queued.sum_decode_kv_ready_tokens),
        kv_transfer_requests=_opt(queued.num_decode_kv_transfer_requests),
        kv_ready_requests=_opt(queued.num_decode_kv_ready_requests),
        scheduled_decode_requests=float(sched.num_decode_requests),
        scheduled_decode_kv_tokens=float(sched.sum_decode_kv_tokens),
        scheduled_prefill_tokens=float(sched.sum_prefill_tokens),
    )


@dataclass(frozen=True)
class ConnectorEvent:
    """One event of the planner's local connector; ``counts[pool]`` has members, serving, starting, standby,
    standby_loading, draining after it."""

    t: float
    event: str
    pool: str
    index: int
    role: str
    state: str = ""
    worker_id: str = ""
    counts: dict[str, dict[str, int]] = field(default_factory=dict, compare=False)
    since: float = 0.0  # state events: when the worker changed state (the connector notices at its next poll)

    @property
    def happened(self) -> float:
        return self.since if self.event == "state" and self.since > 0 else self.t


def parse_connector_event(obj: dict[str, Any]) -> ConnectorEvent | None:
    pool = str(obj.get("pool", ""))
    if pool not in POOLS or "event" not in obj:
        return None
    raw_counts = obj.get("counts")
    counts: dict[str, Any] = raw_counts if isinstance(raw_counts, dict) else {}
    return ConnectorEvent(
        t=_num(obj.get("t")),
        event=str(obj["event"]),
        pool=pool,
        index=int(_num(obj.get("index"))),
        role=str(obj.get("role", "")),
        state=str(obj.get("state", "") or ""),
        worker_id=str(obj.get("worker_id", "") or ""),
        counts={
            str(k): {str(a): int(_num(b)) for a, b in v.items()}
            for k, v in counts.items()
            if isinstance(v, dict)
        },
        since=_num(obj.get("since")),
    )


class JsonlTail:
    """Incremental reader of a JSON-lines file that another process is appending to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._partial = b""
        self.bad_lines = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
                self._pos = fh.tell()
        except OSError:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # incomplete last line (or b"")
        out = []
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                self.bad_lines += 1
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


@dataclass
class Signals:
    """Everything recorded so far: FPM samples, decisions, latest sample per engine."""

    fpm_path: Path
    decision_path: Path
    events_path: Path | None = None
    samples: list[FpmSample] = field(default_factory=list)
    decisions: list[DecisionEntry] = field(default_factory=list)
    events: list[ConnectorEvent] = field(default_factory=list)
    latest: dict[tuple[str, str, int], FpmSample] = field(default_factory=dict)
    stale_after_s: float = 5.0

    def __post_init__(self) -> None:
        self._fpm = JsonlTail(self.fpm_path)
        self._dec = JsonlTail(self.decision_path)
        self._ev = JsonlTail(self.events_path) if self.events_path is not None else None

    def poll(self) -> None:
        for obj in self._fpm.read_new():
            s = parse_fpm_line(obj)
            if s is not None:
                self.samples.append(s)
                self.latest[s.key] = s
        for obj in self._dec.read_new():
            d = parse_entry(obj)
            if d is not None:
                self.decisions.append(d)
        for obj in self._ev.read_new() if self._ev is not None else []:
            e = parse_connector_event(obj)
            if e is not None:
                self.events.append(e)

    def connector_counts(self, pool: str) -> dict[str, int] | None:
        """The pool's counts after the connector's latest event (None: no event yet)."""
        for e in reversed(self.events):
            if pool in e.counts:
                return e.counts[pool]
        return None

    def live_engines(self, now: float | None = None) -> list[FpmSample]:
        now = now if now is not None else time.time()
        return sorted(
            (s for s in self.latest.values() if now - s.t <= self.stale_after_s), key=lambda s: s.key
        )

    def replicas(self, pool: str) -> int | None:
        """Replicas per the planner's latest decision for the pool (its desired count)."""
        for d in reversed(self.decisions):
            if d.pool == pool:
                return d.desired
        return None
