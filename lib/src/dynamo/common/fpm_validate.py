"""What an FPM record, and the subject it came on, may contain: the documented bounds, checked in one place.

``record_problem(record, kv_tokens=None)`` returns ``None`` for a record consumers may use, else a short
reason from a fixed set (reasons are counter keys: they never contain values from the wire).
``subject_problem(component, endpoint)`` does the same for the subject tokens. The tracker and the
planner both call these; nothing else decides what a valid record is.

Bounds (docs/fpm-core.md, "Bounds"):

======================  ==============================================================================
``worker_id``           1 to ``MAX_WORKER_ID_BYTES`` (256) bytes of UTF-8, no control characters
``dp_rank``             0 to ``MAX_DP_RANK`` (4095)
``counter_id``          0 to 2**63 - 1
``wall_time``           finite, 0 to ``MAX_WALL_TIME_S`` (3600) seconds
request counts, tokens  integers, 0 to ``MAX_COUNT`` (2**40); variances finite and >= 0
decode split            parts >= 0; transfer + ready requests <= queued decode requests
held KV (optional)      counts 0 to ``MAX_COUNT``; ``max_held_kv_age`` finite and >= 0
with a KV capacity      queued prefill tokens + queued decode KV, and scheduled decode KV, each at most
                        ``MAX_KV_MULTIPLE`` (1000) times the engine's KV capacity in tokens
subject tokens          component and endpoint 1 to ``MAX_SUBJECT_TOKEN_BYTES`` (128) bytes
======================  ==============================================================================
"""

from __future__ import annotations

import math

from dynamo.common.forward_pass_metrics import ForwardPassMetrics

MAX_WORKER_ID_BYTES = 256
MAX_DP_RANK = 4095
MAX_COUNTER_ID = 2**63 - 1
MAX_WALL_TIME_S = 3600.0
MAX_COUNT = 2**40
MAX_KV_MULTIPLE = 1000
MAX_SUBJECT_TOKEN_BYTES = 128

_SCHEDULED_INTS = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "sum_prefill_kv_tokens",
    "num_decode_requests",
    "sum_decode_kv_tokens",
)
_QUEUED_INTS = ("num_prefill_requests", "sum_prefill_tokens", "num_decode_requests", "sum_decode_kv_tokens")
_QUEUED_SPLIT = (
    "num_decode_kv_transfer_requests",
    "sum_decode_kv_transfer_tokens",
    "num_decode_kv_ready_requests",
    "sum_decode_kv_ready_tokens",
)


def _count_problem(v: object) -> str | None:
    if not isinstance(v, int) or isinstance(v, bool):
        return "not an integer"
    if v < 0:
        return "negative"
    if v > MAX_COUNT:
        return "over 2^40"
    return None


def _variance_ok(v: object) -> bool:
    return isinstance(v, int | float) and math.isfinite(v) and v >= 0


def worker_id_problem(worker_id: str) -> str | None:
    if not worker_id:
        return "empty worker_id"
    if (
        len(worker_id) > MAX_WORKER_ID_BYTES
        or len(worker_id.encode("utf-8", "replace")) > MAX_WORKER_ID_BYTES
    ):
        return f"worker_id over {MAX_WORKER_ID_BYTES} bytes"
    if not worker_id.isprintable():
        return "worker_id has control characters"
    return None


def record_problem(r: ForwardPassMetrics, *, kv_tokens: int | None = None) -> str | None:
    """Why a record cannot be used, or None. ``kv_tokens``: the engine's KV capacity when known."""
    problem = worker_id_problem(r.worker_id)
    if problem is not None:
        return problem
    if not 0 <= r.dp_rank <= MAX_DP_RANK:
        return f"dp_rank out of range 0..{MAX_DP_RANK}"
    if not 0 <= r.counter_id <= MAX_COUNTER_ID:
        return "counter_id out of range"
    if not math.isfinite(r.wall_time) or r.wall_time < 0:
        return "wall_time not a finite non-negative number"
    if r.wall_time > MAX_WALL_TIME_S:
        return f"wall_time over {MAX_WALL_TIME_S:g} s"
    s, q = r.scheduled_requests, r.queued_requests
    for name in _SCHEDULED_INTS:
        problem = _count_problem(getattr(s, name))
        if problem is not None:
            return f"{problem} scheduled {name}"
    for name in _QUEUED_INTS:
        problem = _count_problem(getattr(q, name))
        if problem is not None:
            return f"{problem} queued {name}"
    if not all(
        _variance_ok(v)
        for v in (s.var_prefill_length, s.var_decode_kv_tokens, q.var_prefill_length, q.var_decode_kv_tokens)
    ):
        return "variance not a finite non-negative number"
    parts = [getattr(q, name) for name in _QUEUED_SPLIT]
    if any(p is not None and _count_problem(p) is not None for p in parts):
        return (
            "negative decode transfer/ready split"
            if any(isinstance(p, int) and p < 0 for p in parts)
            else "decode transfer/ready split out of range"
        )
    if (q.num_decode_kv_transfer_requests or 0) + (
        q.num_decode_kv_ready_requests or 0
    ) > q.num_decode_requests:
        return "decode transfer + ready requests exceed queued decode requests"
    problem = held_kv_problem(r)
    if problem is not None:
        return problem
    if kv_tokens is not None and kv_tokens > 0:
        limit = MAX_KV_MULTIPLE * kv_tokens
        if q.sum_prefill_tokens + q.sum_decode_kv_tokens > limit:
            return f"queued tokens over {MAX_KV_MULTIPLE}x the KV capacity"
        if s.sum_decode_kv_tokens > limit:
            return f"scheduled decode KV over {MAX_KV_MULTIPLE}x the KV capacity"
    return None


def held_kv_problem(r: ForwardPassMetrics) -> str | None:
    """The optional held-KV fields: counts in range, the age finite and non-negative."""
    for name in ("num_held_kv_requests", "sum_held_kv_tokens"):
        value = getattr(r, name)
        if value is not None and (problem := _count_problem(value)) is not None:
            return f"{problem} {name}"
    age = r.max_held_kv_age
    if age is not None and not (math.isfinite(age) and age >= 0):
        return "max_held_kv_age not a finite non-negative number"
    return None


def subject_problem(component: str, endpoint: str) -> str | None:
    """Why the subject's component/endpoint tokens cannot be used, or None."""
    for kind, token in (("component", component), ("endpoint", endpoint)):
        if not token:
            return f"empty {kind}"
        if (
            len(token) > MAX_SUBJECT_TOKEN_BYTES
            or len(token.encode("utf-8", "replace")) > MAX_SUBJECT_TOKEN_BYTES
        ):
            return f"{kind} over {MAX_SUBJECT_TOKEN_BYTES} bytes"
    return None
