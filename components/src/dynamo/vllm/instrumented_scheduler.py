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
classifier does not know, the scheduler falls back to a full scan per record (exact, O(queue)); which
methods are hooked and what each is for is the table in ``fpm_hooks``, checked once at start.

All state lives in one object, ``self._fpm`` (``fpm_state.FpmSchedulerState``): the only attribute this mixin
adds to vLLM's scheduler instance.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, QueuedRequestMetrics
from dynamo.vllm.fpm_accounting import IncrementalQueue, summarize_scheduled
from dynamo.vllm.fpm_classifier import (
    KNOWN_WAITING_CONTAINERS,
    Kind,
    PullPending,
    find_request_containers,
    remote_prefill_flag,
    status_kinds,
    unknown_request_containers,
    unknown_statuses,
    waiting_containers,
)
from dynamo.vllm.fpm_env import STAT_KV_PINNED, FpmSettings, dp_rank_of
from dynamo.vllm.fpm_hooks import HookCheck, Role, check_hooks
from dynamo.vllm.fpm_state import PRUNE_PREEMPTED, FpmSchedulerState, HeldKv

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus

# For the type checker the mixin is what it extends at run time: a vLLM scheduler (read as Any while
# mypy's config skips vLLM's own types: docs/type-checking.md). At run time it is a plain mixin, also
# used over stubs.
if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object

logger = logging.getLogger(__name__)

_NO_IDS: frozenset[str] = frozenset()
_MAX_PENDING = 16
# After a queue snapshot the engine thread waits up to this long for the publisher to take it: a loop
# stepping only parked requests can otherwise keep the sender from the GIL for seconds (docs/fpm-core.md).
SNAPSHOT_HANDOVER_S = 0.01


def _state_view(name: str, doc: str) -> Any:
    """A read/write property onto one field of ``self._fpm`` (names the tests and benchmarks inspect)."""

    def get(self: Any) -> Any:
        return getattr(self._fpm, name)

    def put(self: Any, value: Any) -> None:
        setattr(self._fpm, name, value)

    return property(get, put, doc=doc)


def kv_pinned(sched: Any) -> int:
    """Finished requests whose KV blocks the connector still holds (a prefill engine's, until the decode side
    has read them or their lease expired): what vLLM's ``has_finished_requests`` counts."""
    num_running, num_waiting = sched.get_request_counts()
    return max(0, len(sched.requests) - num_running - num_waiting)


class FpmInstrumentation(_SchedulerBase):
    """The instrumentation, as a mixin over a vLLM scheduler class (also used over stub layouts in tests).

    Call ``_fpm_setup()`` at the end of ``__init__``. Until then ``_fpm`` is the class-level 'off' state,
    which keeps every hook a plain pass-through (in case the base constructor calls one).
    """

    _fpm: FpmSchedulerState = FpmSchedulerState()

    # Views for tests and benchmarks (no storage of their own).
    _fpm_pub = _state_view("pub", "The publisher (None when off).")
    _fpm_idle = _state_view("idle", "True while the engine has no work (heartbeats run).")
    _fpm_kinds = _state_view("kinds", "vLLM status -> classifier Kind.")
    _fpm_ever_preempted = _state_view("ever_preempted", "Ids preempted at some point.")
    _fpm_last_publish = _state_view("last_publish", "When the last record or snapshot went out.")

    # --------------------------------------------------------------- setup
    def _fpm_setup(
        self,
        base: type | None = None,
        status_enum: Any = RequestStatus,
        request_type: type = Request,
        queue_types: tuple[type, ...] = (RequestQueue,),
    ) -> None:
        """Read the settings, check ``base`` (default: the class after this mixin) and start publishing."""
        if base is None:
            mro = type(self).__mro__
            base = mro[mro.index(FpmInstrumentation) + 1]
        s = self._fpm = FpmSchedulerState(
            kinds=status_kinds(status_enum), request_type=request_type, queue_types=queue_types
        )
        try:
            settings = FpmSettings.from_env()
        except ValueError as exc:
            logger.error("forward-pass metrics disabled: %s", exc)
            return
        s.settings = settings
        if not settings.enabled:
            logger.info("forward-pass metrics disabled (DYN_FPM_ENABLED=0)")
            return
        # Startup self-check: never publish fabricated zeros.
        containers = waiting_containers(self)
        hooks = check_hooks(base)
        if not containers or not hooks.can_publish:
            what = (
                f"none of the known waiting containers ({', '.join(KNOWN_WAITING_CONTAINERS)}); "
                "publishing would report empty queues that are not empty"
                if not containers
                else f"no method {', '.join(hooks.lacks(Role.RECORD))}; no record could be built"
            )
            logger.error(
                "FORWARD-PASS METRICS DISABLED: %s exposes %s. This vLLM version is not supported by %s.",
                base.__name__,
                what,
                type(self).__name__,
            )
            return
        s.container_names = tuple(name for name, _ in containers)
        s.pull_pending = _pull_pending(getattr(self, "connector", None))
        unknown = unknown_statuses(status_enum)
        if unknown:
            logger.warning(
                "vLLM request statuses unknown to the FPM classifier: %s. Waiting requests with these "
                "statuses are counted as queued prefill (explicit fallback, logged once per status).",
                ", ".join(unknown),
            )
        mode = _accounting_mode(settings.queue_accounting, hooks, unknown, base)
        s.mode = mode
        s.fast_path = hooks.fast_path_ok
        # The drift guard: a request container nobody listed (a new vLLM queue) turns on a full scan over it.
        strangers = unknown_request_containers(find_request_containers(self, request_type, queue_types))
        if strangers:
            s.guard_containers(self, strangers)
            mode = s.mode
        if mode == "incremental":
            s.q = IncrementalQueue(s.kinds, s.unknown_status, s.pull_pending)
            s.q.reset_from(s.scan(self))
        if getattr(self, "connector", None) is not None and not hooks.lacks(Role.HELD_KV):
            s.held = HeldKv()
        s.worker_id = settings.resolved_worker_id()
        s.dp_rank = dp_rank_of(getattr(self, "vllm_config", None))
        s.snapshot_interval = settings.snapshot_interval
        s.audit_interval = settings.audit_interval
        s.next_audit = time.monotonic() + settings.audit_interval
        s.pub = self._fpm_make_publisher(settings, s.worker_id, s.dp_rank)
        s.on = True
        logger.info(
            "forward-pass metrics: worker_id=%s dp_rank=%d %s/%s/%s, queue accounting %s over %s",
            s.worker_id,
            s.dp_rank,
            settings.namespace,
            settings.component,
            settings.endpoint,
            mode,
            ", ".join(s.container_names),
        )

    def _fpm_make_publisher(self, settings: FpmSettings, worker_id: str, dp_rank: int) -> Any:
        """The publisher (overridable in tests): ZMQ PUB for the worker's relay when a port is set, else
        NATS."""
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

    # --------------------------------------------------------------- public introspection
    @property
    def fpm_mode(self) -> str:
        """``incremental``, ``scan`` or ``off``."""
        return self._fpm.mode

    def fpm_queued_metrics(self) -> QueuedRequestMetrics:
        """The queued metrics the next record would carry (reconciles first)."""
        s = self._fpm
        if s.q is None:
            return s.scan(self).totals.metrics()
        ready = getattr(self, "finished_recving_kv_req_ids", _NO_IDS)
        s.q.reconcile(self.requests, ready, s.kv_arrived)
        return s.q.metrics()

    def fpm_scan_queued(self) -> QueuedRequestMetrics:
        """A full scan of every waiting container (the reference)."""
        return self._fpm.scan(self).totals.metrics()

    def fpm_counters(self) -> dict[str, int]:
        return self._fpm.counters.as_dict()

    # --------------------------------------------------------------- vLLM hooks (table: fpm_hooks)
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        s = self._fpm
        if s.on:
            if s.idle:
                s.wake()
            s.touch(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        finished = super().finish_requests(request_ids, finished_status)
        s = self._fpm
        if s.on:
            if finished is not None:
                ids = [r.request_id for r in finished]
            elif request_ids is None:
                ids = []
                s.rebuild = True
            else:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            s.touch_all(ids)
            if s.kv_arrived:
                s.kv_arrived.difference_update(ids)
            if s.ever_preempted:
                s.ever_preempted.difference_update(ids)
            if s.idle and ids:
                s.go_idle(self, time.monotonic())
        return finished

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        s = self._fpm
        if s.on:
            s.ever_preempted.add(request.request_id)
            s.touch(request.request_id)

    def _enqueue_waiting_request(self, request: Any) -> None:
        super()._enqueue_waiting_request(request)
        self._fpm.touch(request.request_id)

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        super()._update_request_as_session(session, update)
        self._fpm.touch(session.request_id)

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        s = self._fpm
        if not s.on:
            return super()._handle_blocked_waiting_request(request)
        status = request.status
        remote = s.kinds.get(status) is Kind.REMOTE_KV
        rid = request.request_id
        failed = remote and rid in getattr(self, "failed_recving_kv_req_ids", _NO_IDS)
        ok = super()._handle_blocked_waiting_request(request)
        if ok or request.status is not status:
            s.touch(rid)
            if remote and not failed and request.status is not status:
                s.kv_arrived.add(rid)
        return ok

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._free_request(request, *args, **kwargs)
        held = self._fpm.held
        if held is not None and request.request_id in self.requests:  # its blocks kept for the connector
            held.hold(request.request_id, time.monotonic(), request.num_computed_tokens)
        return result

    def _free_blocks(self, request: Any) -> Any:
        result = super()._free_blocks(request)
        held = self._fpm.held
        if held is not None:
            held.release(request.request_id)
        return result

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> None:
        super()._update_from_kv_xfer_finished(kv_connector_output)
        if kv_connector_output.finished_recving:
            self._fpm.touch_all(kv_connector_output.finished_recving)

    def _handle_failed_recving(self, failed_req_ids: Any) -> Any:
        result = super()._handle_failed_recving(failed_req_ids)
        self._fpm.touch_all(failed_req_ids)
        return result

    def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._handle_invalid_blocks(*args, **kwargs)
        s = self._fpm
        if s.on:  # rare: num_computed_tokens of parked requests changed in place
            s.rebuild = True
        return result

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        s = self._fpm
        if not s.on:
            return super().schedule(*args, **kwargs)
        if s.idle:
            s.wake()
        output = super().schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            summary = summarize_scheduled(
                output,
                self.requests,
                s.kv_arrived,
                s.ever_preempted,
                fast_path=s.fast_path,
            )
            pending = s.pending
            pending[id(output)] = (output, summary, time.monotonic())
            if len(pending) > _MAX_PENDING:  # outputs never given back: forget the oldest
                del pending[next(iter(pending))]
                s.counters.unmatched_outputs += 1
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        s = self._fpm
        if not s.on:
            return super().update_from_output(scheduler_output, model_runner_output)
        t_start = time.monotonic()
        result = super().update_from_output(scheduler_output, model_runner_output)
        ever = s.ever_preempted
        if ever:
            nst = scheduler_output.num_scheduled_tokens
            q = s.q
            if q is not None and nst and not ever.isdisjoint(nst):
                # Requests preempted after this batch was scheduled get tokens appended or stop here.
                q.touched.update(rid for rid in nst if rid in ever)
            if len(ever) > s.prune_at:
                ever.intersection_update(self.requests)
                s.prune_at = 2 * len(ever) + PRUNE_PREEMPTED
        pending = s.pending.pop(id(scheduler_output), None)
        now = time.monotonic()
        if pending is not None and pending[0] is scheduler_output:
            start = max(pending[2], s.last_update_start)
            s.pub.publish(
                ForwardPassMetrics(
                    worker_id=s.worker_id,
                    dp_rank=s.dp_rank,
                    wall_time=max(0.0, t_start - start),
                    scheduled_requests=pending[1],
                    queued_requests=s.queued(self, now),
                    **s.held_kv_fields(now),
                )
            )
            s.counters.records += 1
            s.last_publish = now
        elif now - s.last_publish >= s.snapshot_interval and self.requests:
            s.pub.publish(s.identity(s.queued(self, now), now))
            s.pub.wait_sent(SNAPSHOT_HANDOVER_S)
            s.counters.snapshots += 1
            s.last_publish = now
        s.last_update_start = t_start
        extra = getattr(s.pub, "extra_stats", None)
        if extra is not None and getattr(self, "connector", None) is not None:
            extra[STAT_KV_PINNED] = kv_pinned(self)
        if not self.has_requests():
            s.go_idle(self, now)
        return result

    def shutdown(self) -> None:
        s = self._fpm
        pub = s.pub
        if pub is not None:
            s.pub = None
            s.on = False
            try:
                pub.close(timeout=1.0)
            except Exception:  # shutdown must go on
                logger.exception("closing the FPM publisher failed")
        super().shutdown()


def _pull_pending(connector: Any) -> PullPending:
    """How to tell a remote-prefill request whose KV pull has not started: the connector's own
    ``may_load_async`` (vLLM 0.34), else the ``do_remote_prefill`` flag; None without a KV connector."""
    if connector is None:
        return None
    may_load_async = getattr(connector, "may_load_async", None)
    return may_load_async if callable(may_load_async) else remote_prefill_flag


def _accounting_mode(requested: str, hooks: HookCheck, unknown: list[str], base: type) -> str:
    """``incremental`` or ``scan`` from the setting and the startup check; one warning when it degrades."""
    if requested == "scan":
        mode = "scan"
    elif hooks.incremental_ok and not (requested == "auto" and unknown):
        mode = "incremental"
    else:
        mode = "scan"
    if hooks.missing:
        logger.warning(
            "%s lacks the hooked scheduler methods %s (renamed or removed in this vLLM?); lost: %s. "
            "Queued metrics: %s%s",
            base.__name__,
            ", ".join(hooks.missing_names),
            "; ".join(hooks.losses()),
            "full scan per record" if mode == "scan" else mode,
            " (DYN_FPM_QUEUE_ACCOUNTING=incremental cannot be honoured)"
            if requested == "incremental" and mode == "scan"
            else "",
        )
    elif mode == "scan" and requested == "auto":
        logger.warning("queued metrics use a full scan per record (unknown statuses: %s)", ", ".join(unknown))
    return mode


class InstrumentedScheduler(FpmInstrumentation, AsyncScheduler):
    """vLLM ``AsyncScheduler`` publishing forward-pass metrics (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fpm_setup()
