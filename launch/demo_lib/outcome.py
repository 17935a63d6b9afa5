"""Did the replica the planner added take load? Computed from the recordings alone (pure, no I/O).

The replica is the decode worker that registered after the first decode scale-up decision of the burst (the
connector's ``serving`` event names its worker id; without connector events, the first decode worker whose
FPM records start after the decision). Its first scheduled work is its first FPM record with scheduled
requests; its share is its decode tokens (one per scheduled decode request per forward pass) over the decode
pool's, from its first work to the burst's end.

The time bar is on when it was ready to serve (the ``serving`` event), which the planner and the connector
decide; its first work also waits for the load's next request, which the demo's closed-loop clients send only
when one of theirs ends (0-12 s later in a burst; docs/demo.md). Without connector events, the first work is
all there is to time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo.planner.decision_log import DecisionEntry

from .signals import ConnectorEvent, FpmSample

# The bar the demo sets: the added replica serves (or, without connector events, works) within this long of
# the decision ...
READY_LIMIT_S = 10.0
# ... and carries at least this share of the decode pool's tokens from then until the burst ends.
MIN_DECODE_SHARE = 0.25


@dataclass(frozen=True)
class ScaledReplica:
    decision_t: float | None = None  # the first decode scale-up decision of the burst
    worker_id: str | None = None
    serving_t: float | None = None  # registered (the connector's event), when known
    first_work_t: float | None = None
    decode_tokens: float = 0.0  # the replica's, from its first work to the burst's end
    pool_decode_tokens: float = 0.0  # the decode pool's, same window

    @property
    def first_work_s(self) -> float | None:
        if self.decision_t is None or self.first_work_t is None:
            return None
        return self.first_work_t - self.decision_t

    @property
    def serving_s(self) -> float | None:
        if self.decision_t is None or self.serving_t is None:
            return None
        return self.serving_t - self.decision_t

    @property
    def ready_s(self) -> float | None:
        """Seconds from the decision to the replica's readiness: its serving event, else its first work."""
        return self.serving_s if self.serving_s is not None else self.first_work_s

    @property
    def decode_share(self) -> float | None:
        if self.first_work_t is None:
            return None
        return self.decode_tokens / self.pool_decode_tokens if self.pool_decode_tokens > 0 else 0.0

    @property
    def took_load(self) -> bool:
        ready, share = self.ready_s, self.decode_share
        # No share without a first work; no readiness without a decision.
        return (
            ready is not None and share is not None and ready <= READY_LIMIT_S and share >= MIN_DECODE_SHARE
        )


def _works(s: FpmSample) -> bool:
    return s.scheduled_decode_requests > 0 or s.scheduled_prefill_tokens > 0


def scaled_replica(
    samples: list[FpmSample],
    decisions: list[DecisionEntry],
    events: list[ConnectorEvent],
    burst_start: float,
    burst_end: float,
    grace_s: float = 30.0,
) -> ScaledReplica:
    ups = sorted(
        (
            d
            for d in decisions
            if d.pool == "decode" and d.direction > 0 and burst_start <= d.ts <= burst_end + grace_s
        ),
        key=lambda d: d.ts,
    )
    if not ups:
        return ScaledReplica()
    t_dec = ups[0].ts
    decode = [s for s in samples if s.pool == "decode"]
    worker, serving_t = None, None
    joined = sorted(
        (
            e
            for e in events
            if e.pool == "decode" and e.state == "serving" and e.worker_id and e.t >= t_dec - 1.0
        ),
        key=lambda e: e.t,
    )
    if joined:
        worker, serving_t = joined[0].worker_id, joined[0].t
    else:
        first_seen: dict[str, float] = {}
        for s in decode:
            first_seen[s.worker] = min(first_seen.get(s.worker, s.t), s.t)
        late = sorted((t, w) for w, t in first_seen.items() if t >= t_dec)
        if late:
            worker = late[0][1]
    if worker is None:
        return ScaledReplica(decision_t=t_dec)
    first_work = min((s.t for s in decode if s.worker == worker and s.t >= t_dec and _works(s)), default=None)
    if first_work is None:
        return ScaledReplica(decision_t=t_dec, worker_id=worker, serving_t=serving_t)
    window = [s for s in decode if first_work <= s.t <= burst_end]
    mine = sum(s.scheduled_decode_requests for s in window if s.worker == worker)
    total = sum(s.scheduled_decode_requests for s in window)
    return ScaledReplica(t_dec, worker, serving_t, first_work, mine, total)


def describe(r: ScaledReplica) -> str:
    """The verdict's line about it."""
    if r.decision_t is None:
        return "Scaled replica took load: NO - no decode scale-up during the burst."
    if r.worker_id is None:
        return "Scaled replica took load: NO - no new decode replica registered after the scale-up decision."
    if r.first_work_s is None:
        return (
            "Scaled replica took load: NO - the added decode replica never scheduled work during the burst."
        )
    share = r.decode_share or 0.0
    verdict = "YES" if r.took_load else "NO"
    bar = f"(bar: {READY_LIMIT_S:.0f} s)"
    if r.serving_s is not None:
        timing = (
            f"serving {r.serving_s:.1f} s after the scale-up decision {bar}, first decode work "
            f"{r.first_work_s:.1f} s after it"
        )
    else:
        timing = f"first decode work {r.first_work_s:.1f} s after the scale-up decision {bar}"
    return (
        f"Scaled replica took load: {verdict} - {timing}; it carried {share * 100:.0f}% of the decode pool's "
        f"tokens from then to the burst's end (bar: {MIN_DECODE_SHARE * 100:.0f}%)."
    )
