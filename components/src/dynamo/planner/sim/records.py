"""The simulator's per-engine FPM snapshot (flattened v1 fields) as the records a live planner receives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)

_SCHEDULED = {
    "num_prefill_requests": "num_prefill_requests",
    "sum_prefill_tokens": "sum_prefill_tokens",
    "var_prefill_length": "var_prefill_length",
    "sum_prefill_kv_tokens": "sum_prefill_kv_tokens",
    "num_decode_requests": "num_decode_requests",
    "sum_decode_kv_tokens": "sum_decode_kv_tokens",
    "var_decode_kv_tokens": "var_decode_kv_tokens",
}
_QUEUED = {
    "num_queued_prefill": "num_prefill_requests",
    "sum_queued_prefill_tokens": "sum_prefill_tokens",
    "var_queued_prefill_length": "var_prefill_length",
    "num_queued_decode": "num_decode_requests",
    "sum_queued_decode_kv_tokens": "sum_decode_kv_tokens",
    "var_queued_decode_kv_tokens": "var_decode_kv_tokens",
}


def worker_id(snapshot_id: int | str) -> str:
    """Simulator worker ids are small integers; live records carry strings."""
    return f"sim-{snapshot_id}"


def to_record(snap: Mapping[str, Any], counter_id: int) -> ForwardPassMetrics:
    """One engine's snapshot -> an FPM v1 record (no transfer/ready split: the mocker does not report it)."""
    scheduled = ScheduledRequestMetrics(**{ours: snap.get(theirs, 0) for theirs, ours in _SCHEDULED.items()})
    queued = QueuedRequestMetrics(**{ours: snap.get(theirs, 0) for theirs, ours in _QUEUED.items()})
    return ForwardPassMetrics(
        worker_id=worker_id(snap["worker_id"]),
        dp_rank=int(snap.get("dp_rank", 0)),
        counter_id=counter_id,
        wall_time=float(snap.get("wall_time", 0.0)),
        scheduled_requests=scheduled,
        queued_requests=queued,
    )


def queue_snapshot(
    last: ForwardPassMetrics | None, snapshot_id: int | str, counter_id: int
) -> ForwardPassMetrics:
    """An engine that ran no pass since the last tick: its queue as its last record left it, nothing
    scheduled, ``wall_time`` 0 (an idle heartbeat when that queue is empty), as a live worker publishes."""
    queued = last.queued_requests if last is not None else QueuedRequestMetrics()
    return ForwardPassMetrics(worker_id=worker_id(snapshot_id), counter_id=counter_id, queued_requests=queued)
