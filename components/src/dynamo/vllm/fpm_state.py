"""Everything the InstrumentedScheduler keeps between engine steps, in one object beside vLLM's own state.

The mixin stores this object as the scheduler's one attribute ``_fpm``, so our names cannot collide with
vLLM's (which add attributes every release), and the hot path reads its fields as slots of a local. The
queued side's operations (full scan, incremental reconcile, audit) live here too: they read the scheduler's
waiting containers but change only this object.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, QueuedRequestMetrics
from dynamo.vllm.fpm_accounting import IncrementalQueue
from dynamo.vllm.fpm_classifier import (
    Kind,
    PullPending,
    ScanResult,
    find_request_containers,
    scan_containers,
    unknown_request_containers,
    waiting_containers,
)
from dynamo.vllm.fpm_env import FpmSettings

logger = logging.getLogger(__name__)

_NO_IDS: frozenset[str] = frozenset()
# Preempted ids are pruned to live requests once the set outgrows this (then twice its size plus this).
PRUNE_PREEMPTED = 1024


@dataclass(slots=True)
class FpmCounters:
    """What ``fpm_counters()`` reports (tests, debugging)."""

    records: int = 0
    snapshots: int = 0
    idle_records: int = 0
    unknown_status: int = 0
    audits: int = 0
    audit_mismatches: int = 0
    unmatched_outputs: int = 0
    unknown_containers: int = 0  # request containers unknown to the classifier (drift guard), found so far

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class HeldKv:
    """Finished requests whose KV blocks the engine keeps for its KV connector (a prefill engine's prompts
    until the decode worker has read them, or vLLM's lease frees them): id -> (held since, KV tokens).

    Filled when vLLM delays freeing a finished request's blocks and emptied when it frees them, so a record
    costs O(1): ids are inserted in time order, the first is the oldest.
    """

    since: dict[str, tuple[float, int]] = field(default_factory=dict)
    tokens: int = 0

    def hold(self, request_id: str, now: float, tokens: int) -> None:
        if request_id not in self.since:
            self.since[request_id] = (now, tokens)
            self.tokens += tokens

    def release(self, request_id: str) -> None:
        entry = self.since.pop(request_id, None)
        if entry is not None:
            self.tokens -= entry[1]

    def fields(self, now: float) -> dict[str, Any]:
        since = self.since
        oldest = next(iter(since.values()))[0] if since else now
        return {
            "num_held_kv_requests": len(since),
            "sum_held_kv_tokens": self.tokens,
            "max_held_kv_age": max(0.0, now - oldest),
        }


@dataclass(slots=True)
class FpmSchedulerState:
    """The instrumentation's state; the default instance is 'off' (every hook a plain pass-through)."""

    on: bool = False
    mode: str = "off"  # incremental | scan | off
    pub: Any = None
    settings: FpmSettings | None = None
    kinds: Mapping[Any, Kind] = field(default_factory=dict)
    container_names: tuple[str, ...] | None = None
    # The drift guard looks for request containers of this type (and vLLM's request-queue classes).
    request_type: type | None = None
    queue_types: tuple[type, ...] = ()
    # Whether a waiting request's KV pull from a remote prefill is still to start (None: no KV connector).
    pull_pending: PullPending = None
    q: IncrementalQueue | None = None  # None: full scan per record
    fast_path: bool = True  # the scheduled side's all-decode fast path (needs the preemption hook)
    worker_id: str = ""
    dp_rank: int = 0
    snapshot_interval: float = 0.0
    audit_interval: float = 0.0
    next_audit: float = 0.0
    # Ids whose remote KV arrived and that were not scheduled since (their first pass is a decode).
    kv_arrived: set[str] = field(default_factory=set)
    # Ids preempted at some point (pruned to live requests): their batches need the per-request rules, and
    # their stale outputs change a queued request in update_from_output.
    ever_preempted: set[str] = field(default_factory=set)
    prune_at: int = PRUNE_PREEMPTED
    # id(SchedulerOutput) -> (output, its summary, when schedule() returned); matched in update_from_output.
    pending: dict[int, tuple[Any, Any, float]] = field(default_factory=dict)
    last_update_start: float = 0.0
    last_publish: float = 0.0
    idle: bool = True
    rebuild: bool = False  # the next record adopts a full scan (after changes no hook can follow)
    unknown_logged: set[str] = field(default_factory=set)
    counters: FpmCounters = field(default_factory=FpmCounters)
    # KV held for a peer (see held_kv_fields); off without a KV connector or the hooks that follow it.
    held: HeldKv | None = None

    # ----------------------------------------------------------- hooks' helper
    def touch(self, rid: str) -> None:
        """Mark one request for re-classification at the next record (incremental mode only)."""
        q = self.q
        if q is not None:
            q.touched.add(rid)

    def touch_all(self, ids: Iterable[str]) -> None:
        q = self.q
        if q is not None:
            q.touched.update(ids)

    # ----------------------------------------------------------- queued side
    def unknown_status(self, name: str) -> None:
        self.counters.unknown_status += 1
        if name not in self.unknown_logged:
            self.unknown_logged.add(name)
            logger.warning(
                "request status %s is unknown to the FPM classifier: counted as queued prefill "
                "(logged once; see fpm_counters()['unknown_status'])",
                name,
            )

    def scan(self, sched: Any) -> ScanResult:
        """A full scan of the scheduler's waiting containers (the reference)."""
        names = self.container_names
        if names is None:  # never set up: look now
            names = tuple(name for name, _ in waiting_containers(sched))
        containers = [c for c in (getattr(sched, name, None) for name in names) if c is not None]
        ready = getattr(sched, "finished_recving_kv_req_ids", _NO_IDS)
        return scan_containers(containers, self.kinds, ready, self.kv_arrived, self.pull_pending)

    def unknown_containers(self, sched: Any) -> list[str]:
        """Request containers of ``sched`` that the classifier does not know and this state does not scan."""
        if self.request_type is None:
            return []
        found = find_request_containers(sched, self.request_type, self.queue_types)
        scanned = set(self.container_names or ())
        return [name for name in unknown_request_containers(found) if name not in scanned]

    def guard_containers(self, sched: Any, unknown: list[str]) -> None:
        """The drift guard's action: scan ``unknown`` too, in full-scan mode, and say so once."""
        self.counters.unknown_containers += len(unknown)
        self.container_names = (*(self.container_names or ()), *unknown)
        self.q = None
        self.mode = "scan"
        logger.warning(
            "vLLM's scheduler holds requests in %s, unknown to the FPM classifier (a queue added by this "
            "vLLM release?): queued metrics now use a full scan per record over %s",
            ", ".join(unknown),
            ", ".join(self.container_names),
        )

    def queued(self, sched: Any, now: float) -> QueuedRequestMetrics:
        """The queued side of the next record: reconciled (or scanned), audited when due.

        When an audit is due the drift guard first looks for request containers filled since the start."""
        due = bool(self.audit_interval) and now >= self.next_audit
        if due:
            self.next_audit = now + self.audit_interval
            unknown = self.unknown_containers(sched)
            if unknown:
                self.guard_containers(sched, unknown)
        q = self.q
        if q is None:
            scan = self.scan(sched)
            for name, count in scan.unknown.items():
                for _ in range(count):
                    self.unknown_status(name)
            return scan.totals.metrics()
        if self.rebuild:
            self.rebuild = False
            q.reset_from(self.scan(sched))
        else:
            q.reconcile(
                sched.requests, getattr(sched, "finished_recving_kv_req_ids", _NO_IDS), self.kv_arrived
            )
        if due:
            self.audit(sched, q)
        return q.metrics()

    def audit(self, sched: Any, q: IncrementalQueue) -> bool:
        """Compare the incremental totals with a full scan; repair on mismatch. True when equal."""
        self.counters.audits += 1
        scan = self.scan(sched)
        if scan.entries == q.entries:
            return True
        self.counters.audit_mismatches += 1
        extra = sorted(set(q.entries) - set(scan.entries))[:5]
        missing = sorted(set(scan.entries) - set(q.entries))[:5]
        logger.warning(
            "FPM queued accounting drifted from a full scan (not in queues: %s; untracked: %s; "
            "not-queued requests found in queues: %s); repaired from the scan",
            extra,
            missing,
            scan.not_queued[:5],
        )
        q.reset_from(scan)
        return False

    # ----------------------------------------------------------- records and the idle heartbeat
    def held_kv_fields(self, now: float) -> dict[str, Any]:
        """The record's held-KV fields (none when they are not tracked: the record then leaves them None)."""
        held = self.held
        return {} if held is None else held.fields(now)

    def identity(self, queued: QueuedRequestMetrics, now: float | None = None) -> ForwardPassMetrics:
        """A record without a scheduled side (snapshots, the idle record)."""
        return ForwardPassMetrics(
            worker_id=self.worker_id,
            dp_rank=self.dp_rank,
            wall_time=0.0,
            queued_requests=queued,
            **(self.held_kv_fields(now) if now is not None else {}),
        )

    def wake(self) -> None:
        self.idle = False
        self.pub.set_idle_record(None)

    def go_idle(self, sched: Any, now: float) -> None:
        self.idle = True
        self.pub.set_idle_record(self.identity(self.queued(sched, now), now))
        self.counters.idle_records += 1
