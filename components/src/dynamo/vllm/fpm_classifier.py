"""Request status -> kind of queued work: the one place that knows vLLM's waiting statuses.

Pure logic over vLLM's request objects (duck-typed: ``request_id``, ``status``,
``num_computed_tokens``, ``num_tokens``); no publishing, no logging on the hot path.

Queued classes (a request in a waiting container, not in this pass):

- ``PREFILL``: ``WAITING``, the structured-output grammar wait (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``,
  older vLLM ``WAITING_FOR_FSM``), ``WAITING_FOR_STREAMING_REQ``. Length (for the variance) =
  ``num_tokens``; tokens still to compute = ``num_tokens - num_computed_tokens`` (equal to ``num_tokens``
  for a fresh request, as upstream counts it).
- ``DECODE_TRANSFER``: ``WAITING_FOR_REMOTE_KVS`` whose KV is still in flight; KV = ``num_computed_tokens``
  (vLLM sets it to the length being transferred in before the data arrives).
- ``DECODE_READY``: ``WAITING_FOR_REMOTE_KVS`` already in ``finished_recving_kv_req_ids`` (arrived, waiting
  for promotion), or a promoted request whose KV arrived and that still waits for a slot
  (``WAITING``/``PREEMPTED`` in the ``kv_arrived`` set); KV = ``num_computed_tokens``.
- ``DECODE_PREEMPTED``: ``PREEMPTED``; KV = ``num_computed_tokens``, or ``num_tokens`` when recompute
  preemption reset ``num_computed_tokens`` to 0 (the context it must rebuild).
- ``UNKNOWN``: a status this module does not know. Explicit fallback: counted as queued prefill
  (like ``WAITING``) and reported by the scheduler (logged once per status, counted).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

from dynamo.common.forward_pass_metrics import IntMoments, QueuedRequestMetrics

# Waiting containers a vLLM scheduler may have, in the order vLLM drains them.
# 0.32/0.33: ``kv_holding_waiting`` + ``waiting``; around 0.18: ``waiting`` + ``skipped_waiting``.
KNOWN_WAITING_CONTAINERS: tuple[str, ...] = ("kv_holding_waiting", "waiting", "skipped_waiting")

PREFILL_STATUSES = frozenset(
    {"WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_FSM", "WAITING_FOR_STREAMING_REQ"}
)
REMOTE_KV_STATUSES = frozenset({"WAITING_FOR_REMOTE_KVS"})
PREEMPTED_STATUSES = frozenset({"PREEMPTED"})
NOT_QUEUED_STATUSES = frozenset({"RUNNING"})  # plus every finished status (name starts with FINISHED_)


class Kind(enum.IntEnum):
    """What a status means for queue accounting (per status, before per-request details)."""

    NOT_QUEUED = 0
    PREFILL = 1
    REMOTE_KV = 2
    PREEMPTED = 3
    UNKNOWN = 4


class QueueClass(enum.IntEnum):
    """Where one queued request is counted."""

    PREFILL = 1
    DECODE_TRANSFER = 2
    DECODE_READY = 3
    DECODE_PREEMPTED = 4
    UNKNOWN = 5  # counted as prefill


def kind_of_status_name(name: str) -> Kind:
    if name in PREFILL_STATUSES:
        return Kind.PREFILL
    if name in REMOTE_KV_STATUSES:
        return Kind.REMOTE_KV
    if name in PREEMPTED_STATUSES:
        return Kind.PREEMPTED
    if name in NOT_QUEUED_STATUSES or name.startswith("FINISHED"):
        return Kind.NOT_QUEUED
    return Kind.UNKNOWN


def status_kinds(status_enum: Iterable[Any]) -> dict[Any, Kind]:
    """The table the hot path looks statuses up in (enum member -> Kind)."""
    return {member: kind_of_status_name(member.name) for member in status_enum}


def unknown_statuses(status_enum: Iterable[Any]) -> list[str]:
    """Names in vLLM's status enum this classifier does not know (startup self-check)."""
    return [m.name for m in status_enum if kind_of_status_name(m.name) is Kind.UNKNOWN]


# A classification: (class, length_or_kv, tokens_to_compute). For decode classes the third is 0.
Entry = tuple[QueueClass, int, int]


def classify(kind: Kind, computed: int, num_tokens: int, kv_ready: bool, kv_arrived: bool) -> Entry | None:
    """Classify one request given its status kind; ``None`` when it is not queued."""
    if kind is Kind.PREFILL:
        if kv_arrived and computed > 0:
            return (QueueClass.DECODE_READY, computed, 0)
        return (QueueClass.PREFILL, num_tokens, num_tokens - computed)
    if kind is Kind.REMOTE_KV:
        return (QueueClass.DECODE_READY if kv_ready else QueueClass.DECODE_TRANSFER, computed, 0)
    if kind is Kind.PREEMPTED:
        if kv_arrived and computed > 0:
            return (QueueClass.DECODE_READY, computed, 0)
        return (QueueClass.DECODE_PREEMPTED, computed if computed > 0 else num_tokens, 0)
    if kind is Kind.NOT_QUEUED:
        return None
    return (QueueClass.UNKNOWN, num_tokens, num_tokens - computed)


def classify_request(
    request: Any, kinds: Mapping[Any, Kind], ready_ids: Any, kv_arrived: Any
) -> tuple[Kind, Entry | None]:
    """Classify a vLLM request object (status looked up in ``kinds``; unknown members -> UNKNOWN)."""
    status = request.status
    kind = kinds.get(status)
    if kind is None:
        kind = kind_of_status_name(getattr(status, "name", str(status)))
    rid = request.request_id
    return kind, classify(
        kind,
        request.num_computed_tokens,
        request.num_tokens,
        rid in ready_ids,
        rid in kv_arrived,
    )


class QueueTotals:
    """Exact running totals of the queued classes; entries are added and removed in any order."""

    __slots__ = ("decode", "prefill", "prefill_tokens", "ready_n", "ready_s", "transfer_n", "transfer_s")

    def __init__(self) -> None:
        self.prefill = IntMoments()  # over lengths (num_tokens)
        self.prefill_tokens = 0  # tokens still to compute
        self.decode = IntMoments()  # over KV tokens, all decode classes
        self.transfer_n = self.transfer_s = 0
        self.ready_n = self.ready_s = 0

    def add(self, entry: Entry) -> None:
        cls, value, tokens = entry
        if cls is QueueClass.PREFILL or cls is QueueClass.UNKNOWN:
            self.prefill.add(value)
            self.prefill_tokens += tokens
            return
        self.decode.add(value)
        if cls is QueueClass.DECODE_TRANSFER:
            self.transfer_n += 1
            self.transfer_s += value
        elif cls is QueueClass.DECODE_READY:
            self.ready_n += 1
            self.ready_s += value

    def remove(self, entry: Entry) -> None:
        cls, value, tokens = entry
        if cls is QueueClass.PREFILL or cls is QueueClass.UNKNOWN:
            self.prefill.remove(value)
            self.prefill_tokens -= tokens
            return
        self.decode.remove(value)
        if cls is QueueClass.DECODE_TRANSFER:
            self.transfer_n -= 1
            self.transfer_s -= value
        elif cls is QueueClass.DECODE_READY:
            self.ready_n -= 1
            self.ready_s -= value

    def metrics(self) -> QueuedRequestMetrics:
        p, d = self.prefill, self.decode
        return QueuedRequestMetrics(
            num_prefill_requests=p.n,
            sum_prefill_tokens=self.prefill_tokens,
            var_prefill_length=p.variance(),
            num_decode_requests=d.n,
            sum_decode_kv_tokens=d.s,
            var_decode_kv_tokens=d.variance(),
            num_decode_kv_transfer_requests=self.transfer_n,
            sum_decode_kv_transfer_tokens=self.transfer_s,
            num_decode_kv_ready_requests=self.ready_n,
            sum_decode_kv_ready_tokens=self.ready_s,
        )


def waiting_containers(scheduler: Any) -> list[tuple[str, Any]]:
    """The known waiting containers this scheduler instance actually has."""
    found = []
    for name in KNOWN_WAITING_CONTAINERS:
        container = getattr(scheduler, name, None)
        if container is not None:
            found.append((name, container))
    return found


class ScanResult:
    """A full scan of the waiting containers: totals, per-request entries, and anomalies seen."""

    __slots__ = ("duplicates", "entries", "not_queued", "totals", "unknown")

    def __init__(self) -> None:
        self.totals = QueueTotals()
        self.entries: dict[str, Entry] = {}
        self.duplicates = 0  # the same request in two containers (counted once)
        self.not_queued: list[str] = []  # running/finished requests found in a waiting container
        self.unknown: dict[str, int] = {}  # unknown status name -> requests


def scan_containers(
    containers: Iterable[Any], kinds: Mapping[Any, Kind], ready_ids: Any, kv_arrived: Any
) -> ScanResult:
    """Classify every request of every container once (the reference the incremental path must equal)."""
    result = ScanResult()
    entries = result.entries
    for container in containers:
        for request in container:
            rid = request.request_id
            if rid in entries:
                result.duplicates += 1
                continue
            kind, entry = classify_request(request, kinds, ready_ids, kv_arrived)
            if entry is None:
                result.not_queued.append(rid)
                continue
            if kind is Kind.UNKNOWN:
                name = getattr(request.status, "name", str(request.status))
                result.unknown[name] = result.unknown.get(name, 0) + 1
            entries[rid] = entry
            result.totals.add(entry)
    return result
