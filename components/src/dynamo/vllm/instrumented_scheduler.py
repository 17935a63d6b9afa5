"""InstrumentedScheduler: vLLM's AsyncScheduler that publishes disaggregation-aware forward-pass metrics.

Inject with ``--scheduler-cls dynamo.vllm.instrumented_scheduler.InstrumentedScheduler`` (or
``LLM(..., scheduler_cls=...)``); configure with the ``DYN_FPM_*`` environment (docs/scheduler.md).
Records go from the engine-core process straight to NATS through ``FpmDirectPublisher`` (no relay).

Why ``AsyncScheduler``: ``--scheduler-cls`` takes one class for both engine loops. Its output
placeholders keep the second ``schedule()`` of the asynchronous loop (two schedules before the first
``update_from_output``) correct, and are added and consumed within one step in the synchronous loop.

What is published (see fpm_accounting / fpm_classifier for the rules):

- one record per non-empty forward pass, from ``update_from_output``: the scheduled side of *that*
  batch (summarised when ``schedule()`` built it and matched by object identity, so both call orders
  are right) and the queued side at that moment;
- while the engine has requests but schedules nothing (e.g. all wait for remote KV), a queue snapshot
  every ``DYN_FPM_SNAPSHOT_INTERVAL`` seconds with ``wall_time == 0.0``;
- heartbeats only while the engine has no work: the publisher repeats the idle record (identity and
  the queued state, all zero when truly idle); they are suspended the moment a request arrives, so none
  can fire in the middle of a pass.

``wall_time`` is the time the batch occupied the executor as seen by the engine core: from when it
could start (its ``schedule()`` returned, or the previous batch's output arrived if that was later)
to when its output reached ``update_from_output``. It excludes the scheduling of the batch itself.

Queued accounting is incremental and exact: hooks on the scheduler methods that change a waiting
request's status, computed tokens or token count record its id, and only those ids are re-classified
("touched"). A full scan of the waiting containers audits it every ``DYN_FPM_AUDIT_INTERVAL`` seconds
(mismatches are logged, counted and repaired). When this vLLM lacks a hook point or has statuses the
classifier does not know, the scheduler falls back to a full scan per record (exact, O(queue)).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, QueuedRequestMetrics
from dynamo.vllm.fpm_accounting import IncrementalQueue, summarize_scheduled
from dynamo.vllm.fpm_classifier import (
    Kind,
    ScanResult,
    scan_containers,
    status_kinds,
    unknown_statuses,
    waiting_containers,
)
from dynamo.vllm.fpm_env import STAT_KV_PINNED, FpmSettings, dp_rank_of

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

logger = logging.getLogger(__name__)

# Scheduler methods the incremental accounting hooks; without them it cannot see every change.
REQUIRED_HOOKS = (
    "add_request",
    "finish_requests",
    "_preempt_request",
    "_handle_blocked_waiting_request",
    "_update_from_kv_xfer_finished",
)
_NO_IDS: frozenset[str] = frozenset()
_MAX_PENDING = 16
_PRUNE_PREEMPTED = 1024


def missing_hooks(base: type) -> list[str]:
    return [name for name in REQUIRED_HOOKS if not callable(getattr(base, name, None))]


class FpmInstrumentation:
    """The instrumentation, as a mixin over a vLLM scheduler class (also used over stub layouts in tests).

    Call ``_fpm_setup(base)`` at the end of ``__init__``. The class attributes below keep every hook a
    plain pass-through until then (in case the base constructor calls one).
    """

    _fpm_on = False
    _fpm_q: IncrementalQueue | None = None
    _fpm_mode = "off"

    # --------------------------------------------------------------- setup
    def _fpm_setup(self, base: type, status_enum: Any = RequestStatus) -> None:
        self._fpm_on = False
        self._fpm_pub: Any = None
        self._fpm_q: IncrementalQueue | None = None
        self._fpm_mode = "off"
        self._fpm_kv_arrived: set[str] = set()
        # Ids preempted at some point (pruned to live requests): their batches need the slow path and
        # their stale outputs change a queued request in update_from_output.
        self._fpm_ever_preempted: set[str] = set()
        self._fpm_prune_at = _PRUNE_PREEMPTED
        self._fpm_pending: dict[int, tuple[Any, Any, float]] = {}
        self._fpm_last_update_start = 0.0
        self._fpm_last_publish = 0.0
        self._fpm_idle = True
        self._fpm_rebuild = False
        self._fpm_unknown_logged: set[str] = set()
        self._fpm_counters = {
            "records": 0,
            "snapshots": 0,
            "idle_records": 0,
            "unknown_status": 0,
            "audits": 0,
            "audit_mismatches": 0,
            "unmatched_outputs": 0,
        }
        self._fpm_kinds = status_kinds(status_enum)
        try:
            settings = FpmSettings.from_env()
        except ValueError as exc:
            logger.error("forward-pass metrics disabled: %s", exc)
            return
        self._fpm_settings = settings
        if not settings.enabled:
            logger.info("forward-pass metrics disabled (DYN_FPM_ENABLED=0)")
            return
        # Startup self-check: never publish fabricated zeros.
        containers = waiting_containers(self)
        if not containers:
            logger.error(
                "FORWARD-PASS METRICS DISABLED: %s exposes none of the known waiting containers "
                "(kv_holding_waiting, waiting, skipped_waiting); publishing would report empty queues "
                "that are not empty. This vLLM version is not supported by %s.",
                base.__name__,
                type(self).__name__,
            )
            return
        self._fpm_container_names = tuple(name for name, _ in containers)
        unknown = unknown_statuses(status_enum)
        if unknown:
            logger.warning(
                "vLLM request statuses unknown to the FPM classifier: %s. Waiting requests with these "
                "statuses are counted as queued prefill (explicit fallback, logged once per status).",
                ", ".join(unknown),
            )
        missing = missing_hooks(base)
        mode = settings.queue_accounting
        if mode == "auto":
            mode = "scan" if (missing or unknown) else "incremental"
        elif mode == "incremental" and missing:
            logger.warning(
                "DYN_FPM_QUEUE_ACCOUNTING=incremental needs scheduler methods %s that this vLLM lacks; "
                "using full scans",
                missing,
            )
            mode = "scan"
        if mode == "scan" and settings.queue_accounting == "auto":
            logger.warning(
                "queued metrics use a full scan per record (missing hooks: %s; unknown statuses: %s)",
                missing or "none",
                unknown or "none",
            )
        self._fpm_mode = mode
        if mode == "incremental":
            self._fpm_q = IncrementalQueue(self._fpm_kinds, self._fpm_unknown_status)
            self._fpm_q.reset_from(self._fpm_scan())
        self._fpm_worker_id = settings.resolved_worker_id()
        self._fpm_dp_rank = dp_rank_of(getattr(self, "vllm_config", None))
        self._fpm_next_audit = time.monotonic() + settings.audit_interval
        self._fpm_pub = self._fpm_make_publisher(settings, self._fpm_worker_id, self._fpm_dp_rank)
        self._fpm_on = True
        logger.info(
            "forward-pass metrics: worker_id=%s dp_rank=%d %s/%s/%s, queue accounting %s over %s",
            self._fpm_worker_id,
            self._fpm_dp_rank,
            settings.namespace,
            settings.component,
            settings.endpoint,
            mode,
            ", ".join(self._fpm_container_names),
        )

    def _fpm_make_publisher(self, settings: FpmSettings, worker_id: str, dp_rank: int) -> Any:
        """The publisher (overridable in tests): ZMQ PUB for the worker's relay when a port is set, else NATS."""
        from dynamo.common.fpm_publisher import FpmDirectPublisher

        common: dict[str, Any] = dict(
            namespace=settings.namespace,
            component=settings.component,
            endpoint=settings.endpoint,
            worker_id=worker_id,
            dp_rank=dp_rank,
            heartbeat_interval=settings.heartbeat_interval,
            stats_file=settings.stats_file_for(dp_rank),
            gate_file=settings.gate_file,
        )
        if settings.zmq_port is not None:
            from dynamo.common.event_plane import zmq_fpm_endpoint
            from dynamo.common.fpm_zmq_publisher import FpmZmqPublisher

            return FpmZmqPublisher(zmq_endpoint=zmq_fpm_endpoint(settings.zmq_port, dp_rank), **common)
        return FpmDirectPublisher(nats_url=settings.nats_url, **common)

    # --------------------------------------------------------------- queued state
    def _fpm_unknown_status(self, name: str) -> None:
        self._fpm_counters["unknown_status"] += 1
        if name not in self._fpm_unknown_logged:
            self._fpm_unknown_logged.add(name)
            logger.warning(
                "request status %s is unknown to the FPM classifier: counted as queued prefill "
                "(logged once; see fpm_counters()['unknown_status'])",
                name,
            )

    def _fpm_ready_ids(self) -> Any:
        return getattr(self, "finished_recving_kv_req_ids", _NO_IDS)

    def _fpm_scan(self) -> ScanResult:
        containers = [getattr(self, name) for name in self._fpm_container_names_or_found()]
        return scan_containers(containers, self._fpm_kinds, self._fpm_ready_ids(), self._fpm_kv_arrived)

    def _fpm_container_names_or_found(self) -> tuple[str, ...]:
        names = getattr(self, "_fpm_container_names", None)
        if names is None:
            names = tuple(name for name, _ in waiting_containers(self))
        return names

    def _fpm_queued(self, now: float) -> QueuedRequestMetrics:
        q = self._fpm_q
        if q is None:
            scan = self._fpm_scan()
            for name, count in scan.unknown.items():
                for _ in range(count):
                    self._fpm_unknown_status(name)
            return scan.totals.metrics()
        if self._fpm_rebuild:
            self._fpm_rebuild = False
            q.reset_from(self._fpm_scan())
        else:
            q.reconcile(self.requests, self._fpm_ready_ids(), self._fpm_kv_arrived)
        if self._fpm_settings.audit_interval and now >= self._fpm_next_audit:
            self._fpm_next_audit = now + self._fpm_settings.audit_interval
            self._fpm_audit(q)
        return q.metrics()

    def _fpm_audit(self, q: IncrementalQueue) -> bool:
        """Compare the incremental totals with a full scan; repair on mismatch. True when equal."""
        self._fpm_counters["audits"] += 1
        scan = self._fpm_scan()
        if scan.entries == q.entries:
            return True
        self._fpm_counters["audit_mismatches"] += 1
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

    # --------------------------------------------------------------- public introspection
    @property
    def fpm_mode(self) -> str:
        """``incremental``, ``scan`` or ``off``."""
        return self._fpm_mode

    def fpm_queued_metrics(self) -> QueuedRequestMetrics:
        """The queued metrics the next record would carry (reconciles first)."""
        if self._fpm_q is None:
            return self._fpm_scan().totals.metrics()
        self._fpm_q.reconcile(self.requests, self._fpm_ready_ids(), self._fpm_kv_arrived)
        return self._fpm_q.metrics()

    def fpm_scan_queued(self) -> QueuedRequestMetrics:
        """A full scan of every waiting container (the reference)."""
        return self._fpm_scan().totals.metrics()

    def fpm_counters(self) -> dict[str, int]:
        return dict(self._fpm_counters)

    # --------------------------------------------------------------- records
    def _fpm_identity(self, queued: QueuedRequestMetrics) -> ForwardPassMetrics:
        return ForwardPassMetrics(
            worker_id=self._fpm_worker_id, dp_rank=self._fpm_dp_rank, wall_time=0.0, queued_requests=queued
        )

    def _fpm_wake(self) -> None:
        self._fpm_idle = False
        self._fpm_pub.set_idle_record(None)

    def _fpm_go_idle(self, now: float) -> None:
        self._fpm_idle = True
        self._fpm_pub.set_idle_record(self._fpm_identity(self._fpm_queued(now)))
        self._fpm_counters["idle_records"] += 1

    def _fpm_touch_ids(self, ids: Any) -> None:
        q = self._fpm_q
        if q is not None:
            q.touched.update(ids)

    # --------------------------------------------------------------- vLLM hooks
    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        if self._fpm_on:
            if self._fpm_idle:
                self._fpm_wake()
            q = self._fpm_q
            if q is not None:
                q.touched.add(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        if self._fpm_on:
            if finished is not None:
                ids = [r.request_id for r in finished]
            elif request_ids is None:
                ids = []
                self._fpm_rebuild = True
            else:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            self._fpm_touch_ids(ids)
            if self._fpm_kv_arrived:
                self._fpm_kv_arrived.difference_update(ids)
            if self._fpm_ever_preempted:
                self._fpm_ever_preempted.difference_update(ids)
            if self._fpm_idle and ids:
                self._fpm_go_idle(time.monotonic())
        return finished

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        if self._fpm_on:
            self._fpm_ever_preempted.add(request.request_id)
            q = self._fpm_q
            if q is not None:
                q.touched.add(request.request_id)

    def _enqueue_waiting_request(self, request: Any) -> None:
        super()._enqueue_waiting_request(request)  # type: ignore[misc]
        q = self._fpm_q
        if q is not None:
            q.touched.add(request.request_id)

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        super()._update_request_as_session(session, update)  # type: ignore[misc]
        q = self._fpm_q
        if q is not None:
            q.touched.add(session.request_id)

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        status = request.status
        if not self._fpm_on:
            return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]
        remote = self._fpm_kinds.get(status) is Kind.REMOTE_KV
        rid = request.request_id
        failed = remote and rid in getattr(self, "failed_recving_kv_req_ids", _NO_IDS)
        ok = super()._handle_blocked_waiting_request(request)  # type: ignore[misc]
        if ok or request.status is not status:
            q = self._fpm_q
            if q is not None:
                q.touched.add(rid)
            if remote and not failed and request.status is not status:
                self._fpm_kv_arrived.add(rid)
        return ok

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> None:
        super()._update_from_kv_xfer_finished(kv_connector_output)  # type: ignore[misc]
        if kv_connector_output.finished_recving:
            self._fpm_touch_ids(kv_connector_output.finished_recving)

    def _handle_failed_recving(self, failed_req_ids: Any) -> Any:
        result = super()._handle_failed_recving(failed_req_ids)  # type: ignore[misc]
        self._fpm_touch_ids(failed_req_ids)
        return result

    def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._handle_invalid_blocks(*args, **kwargs)  # type: ignore[misc]
        self._fpm_rebuild = True  # rare: num_computed_tokens of parked requests changed in place
        return result

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fpm_on:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._fpm_idle:
            self._fpm_wake()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if output.total_num_scheduled_tokens:
            summary = summarize_scheduled(
                output, self.requests, self._fpm_kv_arrived, self._fpm_ever_preempted
            )
            pending = self._fpm_pending
            pending[id(output)] = (output, summary, time.monotonic())
            if len(pending) > _MAX_PENDING:  # outputs never given back: forget the oldest
                del pending[next(iter(pending))]
                self._fpm_counters["unmatched_outputs"] += 1
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self._fpm_on:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        t_start = time.monotonic()
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        ever = self._fpm_ever_preempted
        if ever:
            nst = scheduler_output.num_scheduled_tokens
            q = self._fpm_q
            if q is not None and nst and not ever.isdisjoint(nst):
                # Requests preempted after this batch was scheduled get tokens appended or stop here.
                q.touched.update(rid for rid in nst if rid in ever)
            if len(ever) > self._fpm_prune_at:
                ever.intersection_update(self.requests)
                self._fpm_prune_at = 2 * len(ever) + _PRUNE_PREEMPTED
        pending = self._fpm_pending.pop(id(scheduler_output), None)
        now = time.monotonic()
        if pending is not None and pending[0] is scheduler_output:
            start = max(pending[2], self._fpm_last_update_start)
            self._fpm_pub.publish(
                ForwardPassMetrics(
                    worker_id=self._fpm_worker_id,
                    dp_rank=self._fpm_dp_rank,
                    wall_time=max(0.0, t_start - start),
                    scheduled_requests=pending[1],
                    queued_requests=self._fpm_queued(now),
                )
            )
            self._fpm_counters["records"] += 1
            self._fpm_last_publish = now
        elif now - self._fpm_last_publish >= self._fpm_settings.snapshot_interval and self.requests:
            self._fpm_pub.publish(self._fpm_identity(self._fpm_queued(now)))
            self._fpm_counters["snapshots"] += 1
            self._fpm_last_publish = now
        self._fpm_last_update_start = t_start
        extra = getattr(self._fpm_pub, "extra_stats", None)
        if extra is not None and getattr(self, "connector", None) is not None:
            extra[STAT_KV_PINNED] = self._fpm_kv_pinned()
        if not self.has_requests():  # type: ignore[attr-defined]
            self._fpm_go_idle(now)
        return result

    def _fpm_kv_pinned(self) -> int:
        """Finished requests whose KV blocks the connector still holds (a prefill engine's, until the decode side
        has read them or their lease expired): what vLLM's ``has_finished_requests`` counts."""
        num_running, num_waiting = self.get_request_counts()  # type: ignore[attr-defined]
        return max(0, len(self.requests) - num_running - num_waiting)

    def shutdown(self) -> None:
        pub = getattr(self, "_fpm_pub", None)
        if pub is not None:
            self._fpm_pub = None
            self._fpm_on = False
            try:
                pub.close(timeout=1.0)
            except Exception:  # shutdown must go on
                logger.exception("closing the FPM publisher failed")
        super().shutdown()  # type: ignore[misc]


class InstrumentedScheduler(FpmInstrumentation, AsyncScheduler):
    """vLLM ``AsyncScheduler`` publishing forward-pass metrics (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fpm_setup(Scheduler)
