"""Forward-pass metrics (FPM) record, version 1: the wire contract shared with upstream Dynamo.

Same import path, names, field names and field order as upstream Dynamo's
``dynamo.common.forward_pass_metrics`` so existing consumers switch without code changes.
Records are msgpack *maps* keyed by field name (no ``array_like``), in declaration order.

Compatibility rules (see README, "Wire contract"):
- upstream decoders ignore unknown keys, so we only ever *append* optional fields;
- our extension fields default to ``None`` ("not carried"), so a consumer can tell an upstream
  record (field absent) from one of ours that reports zero;
- ``decode()`` never raises: bad bytes and unknown versions return ``None`` and are counted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)

FPM_VERSION: int = 1


class WelfordAccumulator:
    """Count, integer sum and population variance in one numerically stable pass.

    Upstream-compatible API (``add``, ``n``, ``s``, ``variance()``); used where values arrive once.
    For values that also leave (incremental queue accounting) use :class:`IntMoments`.
    """

    __slots__ = ("_m2", "_mean", "n", "s")

    def __init__(self) -> None:
        self.n = 0
        self.s = 0
        self._mean = 0.0
        self._m2 = 0.0

    def add(self, v: int) -> None:
        self.n += 1
        self.s += v
        delta = v - self._mean
        self._mean += delta / self.n
        self._m2 += delta * (v - self._mean)

    def variance(self) -> float:
        return self._m2 / self.n if self.n else 0.0


class IntMoments:
    """Exact count / sum / sum of squares of integers, with removal.

    Python integers never overflow, so adding and removing in any order leaves exactly the
    moments a fresh scan would produce; ``variance()`` is one correctly rounded division of
    exact integers (at least as precise as Welford's pass).
    """

    __slots__ = ("n", "s", "sq")

    def __init__(self) -> None:
        self.n = 0
        self.s = 0
        self.sq = 0

    def add(self, v: int) -> None:
        self.n += 1
        self.s += v
        self.sq += v * v

    def remove(self, v: int) -> None:
        self.n -= 1
        self.s -= v
        self.sq -= v * v

    def variance(self) -> float:
        n = self.n
        if n <= 0:
            return 0.0
        return (n * self.sq - self.s * self.s) / (n * n)

    def clear(self) -> None:
        self.n = self.s = self.sq = 0


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """What ran in this forward pass."""

    # New requests and chunked-prefill continuations (and, in ours, recompute resumptions).
    num_prefill_requests: int = 0
    # Tokens freshly computed for prefill this pass (chunk sizes).
    sum_prefill_tokens: int = 0
    # Population variance of the *full* prompt lengths (attention cost), not of chunk sizes.
    var_prefill_length: float = 0.0
    # KV read but not computed by prefill requests: prefix-cache hits and earlier chunks.
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    # Sum of the context lengths of the decoding requests.
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Requests waiting, not in this pass. Raw totals: prefix-cache effects are unknown until scheduled."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    # Queued decode work: requests waiting for remote KV and preempted requests.
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0
    # --- Optional extensions (ours; upstream ignores them). None = not reported by the producer. ---
    # Part of the queued decode above whose KV is still being transferred from a prefill worker.
    num_decode_kv_transfer_requests: int | None = None
    sum_decode_kv_transfer_tokens: int | None = None
    # Part of the queued decode above whose KV has arrived and which waits only for a slot.
    num_decode_kv_ready_requests: int | None = None
    sum_decode_kv_ready_tokens: int | None = None


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """One record per forward pass of one engine (worker_id, dp_rank).

    ``wall_time`` is 0.0 for records that are not timing samples: idle heartbeats (everything zero)
    and queue snapshots published while the engine has requests but nothing can run.
    """

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    # Monotonic per (worker_id, dp_rank) publisher: gaps mean lost records, a decrease means a restart.
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()
    # --- Optional extensions (ours; upstream ignores them). None = not reported by the producer. ---
    # KV the engine holds for finished requests until a peer has read it or its lease runs out (a prefill
    # engine's prompts waiting for their decode worker's pull): capacity no new request can use. A dead or
    # slow decode worker shows here, not in the queues.
    num_held_kv_requests: int | None = None
    sum_held_kv_tokens: int | None = None
    # Seconds the oldest of them has been held (0.0 when none).
    max_held_kv_age: float | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)


def encode(metrics: ForwardPassMetrics) -> bytes:
    return _encoder.encode(metrics)


@dataclass
class DecodeFailures:
    """Why records were rejected by :func:`decode` in this process (thread-safe counters)."""

    undecodable: int = 0
    wrong_version: int = 0

    def total(self) -> int:
        return self.undecodable + self.wrong_version


_failures = DecodeFailures()
_failures_lock = threading.Lock()
_warned: set[str] = set()


def decode_failures() -> DecodeFailures:
    """A snapshot of the rejection counters."""
    with _failures_lock:
        return DecodeFailures(_failures.undecodable, _failures.wrong_version)


def _reject(reason: str, detail: str) -> None:
    with _failures_lock:
        setattr(_failures, reason, getattr(_failures, reason) + 1)
        first = reason not in _warned
        _warned.add(reason)
    if first:  # once per reason: a flood of garbage must not flood the log
        logger.warning(
            "rejecting ForwardPassMetrics record (%s): %s; further ones are only counted", reason, detail
        )


def decode(data: bytes | bytearray | memoryview) -> ForwardPassMetrics | None:
    """Decode one record; ``None`` (counted, never raised) for bad bytes or another version."""
    try:
        metrics = _decoder.decode(data)
    except Exception as exc:  # msgspec raises DecodeError/ValidationError; anything else is also bad input
        _reject("undecodable", str(exc)[:200])
        return None
    if metrics.version != FPM_VERSION:
        _reject("wrong_version", f"version {metrics.version}, expected {FPM_VERSION}")
        return None
    return metrics


def is_heartbeat(metrics: ForwardPassMetrics) -> bool:
    """An idle heartbeat: identity only, nothing scheduled, queued or held for a peer."""
    return (
        metrics.wall_time == 0.0
        and metrics.scheduled_requests == _EMPTY_SCHEDULED
        and metrics.queued_requests.num_prefill_requests == 0
        and metrics.queued_requests.num_decode_requests == 0
        and not metrics.num_held_kv_requests
    )


_EMPTY_SCHEDULED = ScheduledRequestMetrics()
