"""Classifier, settings and the older ``skipped_waiting`` layout, on stub requests and a stub scheduler.

The real-scheduler behaviour is covered in test_scheduler_real.py; these pin the pure rules and the
layouts this vLLM no longer has.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
from dynamo.vllm import fpm_env as env_mod
from dynamo.vllm.fpm_accounting import IncrementalQueue
from dynamo.vllm.fpm_classifier import (
    Kind,
    QueueClass,
    classify,
    find_request_containers,
    kind_of_status_name,
    remote_prefill_flag,
    requests_in,
    scan_containers,
    status_kinds,
    unknown_request_containers,
    unknown_statuses,
)
from dynamo.vllm.fpm_env import FpmSettings, dp_rank_of
from dynamo.vllm.instrumented_scheduler import FpmInstrumentation
from dynamo_fpm_testing.scheduler_support import ListPublisher, fpm_env


class OldStatus(enum.IntEnum):
    """The status enum of vLLM around 0.18 (grammar wait was WAITING_FOR_FSM)."""

    WAITING = 1
    WAITING_FOR_FSM = 2
    WAITING_FOR_REMOTE_KVS = 3
    RUNNING = 4
    PREEMPTED = 5
    FINISHED_STOPPED = 6
    FINISHED_ABORTED = 7


class FutureStatus(enum.IntEnum):
    WAITING = 1
    WAITING_FOR_ENCODER_CACHE = 2  # a status this classifier does not know
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5


def req(rid: str, status: Any, computed: int = 0, tokens: int = 10) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, status=status, num_computed_tokens=computed, num_tokens=tokens)


# ---------------------------------------------------------------- classifier rules
def test_status_kinds_cover_this_vllm() -> None:
    from vllm.v1.request import RequestStatus

    assert unknown_statuses(RequestStatus) == []
    kinds = status_kinds(RequestStatus)
    assert kinds[RequestStatus.WAITING_FOR_REMOTE_KVS] is Kind.REMOTE_KV
    assert kinds[RequestStatus.PREEMPTED] is Kind.PREEMPTED
    assert kinds[RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR] is Kind.PREFILL
    assert kinds[RequestStatus.WAITING_FOR_STREAMING_REQ] is Kind.PREFILL
    assert kinds[RequestStatus.RUNNING] is Kind.NOT_QUEUED
    assert kinds[RequestStatus.FINISHED_ABORTED] is Kind.NOT_QUEUED
    assert kind_of_status_name("WAITING_FOR_FSM") is Kind.PREFILL
    assert unknown_statuses(FutureStatus) == ["WAITING_FOR_ENCODER_CACHE"]


def test_classify_rules() -> None:
    # Fresh prefill: length and tokens are num_tokens; a partly computed one has fewer tokens to go.
    assert classify(Kind.PREFILL, 0, 50, False, False) == (QueueClass.PREFILL, 50, 50)
    assert classify(Kind.PREFILL, 20, 50, False, False) == (QueueClass.PREFILL, 50, 30)
    # Remote KV: KV = num_computed_tokens; in flight vs arrived.
    assert classify(Kind.REMOTE_KV, 63, 64, False, False) == (QueueClass.DECODE_TRANSFER, 63, 0)
    assert classify(Kind.REMOTE_KV, 63, 64, True, False) == (QueueClass.DECODE_READY, 63, 0)
    # Promoted after its KV arrived but still waiting for a slot: ready decode, not prefill.
    assert classify(Kind.PREFILL, 63, 64, False, True) == (QueueClass.DECODE_READY, 63, 0)
    # Recompute preemption reset num_computed_tokens: the context to rebuild is num_tokens.
    assert classify(Kind.PREEMPTED, 0, 81, False, False) == (QueueClass.DECODE_PREEMPTED, 81, 0)
    assert classify(Kind.PREEMPTED, 40, 81, False, False) == (QueueClass.DECODE_PREEMPTED, 40, 0)
    assert classify(Kind.NOT_QUEUED, 5, 10, False, False) is None
    assert classify(Kind.UNKNOWN, 0, 7, False, False) == (QueueClass.UNKNOWN, 7, 7)
    # A remote prefill whose KV pull has not started: queued decode with the context it will hold.
    assert classify(Kind.PREFILL, 0, 64, False, False, True) == (QueueClass.DECODE_PENDING, 64, 0)
    # Once anything is computed here the flag is not looked at (a chunk in progress is prefill).
    assert classify(Kind.PREFILL, 20, 64, False, False, True) == (QueueClass.PREFILL, 64, 44)


def test_a_pending_pull_is_queued_decode_in_neither_split_part() -> None:
    remote = req("r", OldStatus.WAITING, 0, 64)
    remote.kv_transfer_params = {"do_remote_prefill": True}
    local = req("l", OldStatus.WAITING, 0, 30)
    local.kv_transfer_params = None
    kinds = status_kinds(OldStatus)
    m = scan_containers([[remote, local]], kinds, set(), set(), remote_prefill_flag).totals.metrics()
    assert (m.num_prefill_requests, m.sum_prefill_tokens) == (1, 30)
    assert (m.num_decode_requests, m.sum_decode_kv_tokens) == (1, 64)
    assert (m.num_decode_kv_transfer_requests, m.num_decode_kv_ready_requests) == (0, 0)
    # Without a KV connector (no predicate) the flag means nothing: prefill, as before.
    m = scan_containers([[remote, local]], kinds, set(), set()).totals.metrics()
    assert (m.num_prefill_requests, m.num_decode_requests) == (2, 0)
    # The incremental path agrees, and follows the flag being cleared when the pull is set up.
    q = IncrementalQueue(kinds, pull_pending=remote_prefill_flag)
    q.touched.update({"r", "l"})
    q.reconcile({"r": remote, "l": local}, set(), set())
    assert (
        q.metrics()
        == scan_containers([[remote, local]], kinds, set(), set(), remote_prefill_flag).totals.metrics()
    )


# ---------------------------------------------------------------- the drift guard's finder
class Request:
    """Stands for vLLM's ``Request`` (the finder matches the annotation's name and the instance's type)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class StubQueue(deque[Any]):
    """Stands for vLLM's ``RequestQueue``."""


class GuardedBase:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # annotated
        self.waiting = StubQueue()  # a request queue by type
        self.new_queue = StubQueue()  # a request queue nobody listed
        self.new_set: set[Request] = set()  # annotated, empty
        self.by_request: dict[Any, int] = {Request("x"): 1}  # keys are requests (by content)
        self.ids: set[str] = {"x"}  # not requests
        self.later: list[Any] = []  # un-annotated, empty: invisible until it holds a request
        self.count = 3


def test_the_finder_sees_queues_annotated_and_filled_containers() -> None:
    found = find_request_containers(GuardedBase(), Request, (StubQueue,))
    assert set(found) == {"requests", "waiting", "new_queue", "new_set", "by_request"}
    assert unknown_request_containers(found) == ["by_request", "new_queue", "new_set"]
    assert [r.request_id for r in requests_in(found["by_request"])] == ["x"]
    assert [r.request_id for r in requests_in({"a": Request("a")})] == ["a"]


def test_a_container_filled_later_is_found_at_the_next_audit(caplog: pytest.LogCaptureFixture) -> None:
    class Later(FpmInstrumentation, OldLayoutBase):
        def __init__(self) -> None:
            super().__init__()
            self.later: list[Any] = []
            self._fpm_setup(OldLayoutBase, OldStatus, request_type=SimpleNamespace)

        def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
            return ListPublisher()

    env = dict(DYN_FPM_WORKER_ID="later", DYN_FPM_SNAPSHOT_INTERVAL="0.01", DYN_FPM_AUDIT_INTERVAL="30")
    with caplog.at_level(logging.WARNING), fpm_env(**env):
        sched = Later()
        assert sched.fpm_counters()["unknown_containers"] == 0
        hidden = req("h", OldStatus.WAITING, 0, 12)
        sched.requests["h"] = hidden
        sched.later.append(hidden)  # a container the guard could not see while it was empty
        sched.update_from_output(sched.schedule(), None)
        assert sched._fpm_pub.records[-1].queued_requests.num_prefill_requests == 0  # not due yet: missed
        sched._fpm.next_audit = 0.0
        sched._fpm_last_publish = 0.0
        sched.update_from_output(sched.schedule(), None)
    q = sched._fpm_pub.records[-1].queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (1, 12)
    assert sched.fpm_counters()["unknown_containers"] == 1 and sched.fpm_mode == "scan"
    assert len([r for r in caplog.records if "later" in r.getMessage()]) == 1


def test_scan_counts_each_request_once_over_old_layout() -> None:
    a = req("a", OldStatus.WAITING, 0, 30)
    b = req("b", OldStatus.WAITING_FOR_REMOTE_KVS, 47, 48)
    c = req("c", OldStatus.PREEMPTED, 0, 90)
    d = req("d", OldStatus.WAITING_FOR_FSM, 0, 12)
    waiting = deque([a, c])
    skipped_waiting = deque([b, d, a])  # `a` twice: counted once
    scan = scan_containers([waiting, skipped_waiting], status_kinds(OldStatus), {"b"}, set())
    m = scan.totals.metrics()
    assert scan.duplicates == 1
    assert (m.num_prefill_requests, m.sum_prefill_tokens) == (2, 42)
    assert (m.num_decode_requests, m.sum_decode_kv_tokens) == (2, 47 + 90)
    assert (m.num_decode_kv_ready_requests, m.sum_decode_kv_ready_tokens) == (1, 47)
    assert (m.num_decode_kv_transfer_requests, m.sum_decode_kv_transfer_tokens) == (0, 0)


def test_incremental_equals_scan_under_add_change_remove() -> None:
    kinds = status_kinds(OldStatus)
    requests = {f"r{i}": req(f"r{i}", OldStatus.WAITING, 0, 10 + i) for i in range(6)}
    q = IncrementalQueue(kinds)
    q.touched.update(requests)
    q.reconcile(requests, set(), set())
    requests["r1"].status = OldStatus.RUNNING
    requests["r2"].status = OldStatus.WAITING_FOR_REMOTE_KVS
    requests["r2"].num_computed_tokens = 11
    del requests["r3"]
    q.touched.update({"r1", "r2", "r3"})
    q.reconcile(requests, {"r2"}, set())
    queued = [r for r in requests.values() if kinds[r.status] is not Kind.NOT_QUEUED]
    assert q.metrics() == scan_containers([queued], kinds, {"r2"}, set()).totals.metrics()


# ---------------------------------------------------------------- settings
def test_settings_defaults_and_overrides() -> None:
    s = FpmSettings.from_env({})
    assert (s.enabled, s.namespace, s.component, s.endpoint) == (True, "dynamo", "backend", "generate")
    assert s.worker_id is None and s.nats_url is None and s.stats_file is None
    assert (s.snapshot_interval, s.heartbeat_interval, s.audit_interval) == (0.25, 1.0, 30.0)
    s = FpmSettings.from_env(
        {
            "DYN_FPM_ENABLED": "off",
            "DYN_NAMESPACE": "ns",
            "DYN_FPM_COMPONENT": "prefill",
            "DYN_FPM_ENDPOINT": "gen",
            "DYN_FPM_WORKER_ID": "42",
            "NATS_SERVER": "nats://h:1",
            "DYN_FPM_STATS_FILE": "/x/fpm-{dp_rank}.json",
            "DYN_FPM_SNAPSHOT_INTERVAL": "0.1",
            "DYN_FPM_AUDIT_INTERVAL": "0",
            "DYN_FPM_QUEUE_ACCOUNTING": "scan",
        }
    )
    assert (s.enabled, s.namespace, s.component, s.endpoint, s.worker_id) == (
        False,
        "ns",
        "prefill",
        "gen",
        "42",
    )
    assert s.stats_file_for(3) == "/x/fpm-3.json" and s.audit_interval == 0.0
    assert s.queue_accounting == "scan" and s.snapshot_interval == 0.1
    for bad in (
        {"DYN_FPM_ENABLED": "maybe"},
        {"DYN_FPM_SNAPSHOT_INTERVAL": "0"},
        {"DYN_FPM_QUEUE_ACCOUNTING": "x"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FpmSettings.from_env(bad)


def test_missing_worker_id_warns_once_with_a_stable_fallback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=env_mod.__name__):
        first = FpmSettings.from_env({}).resolved_worker_id()
    assert first == env_mod.fallback_worker_id() == FpmSettings().resolved_worker_id()
    assert [r for r in caplog.records if "DYN_FPM_WORKER_ID" in r.getMessage()]


def test_dp_rank_prefers_data_parallel_index() -> None:
    both = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=2, data_parallel_rank=5))
    assert dp_rank_of(both) == 2
    assert dp_rank_of(SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=3))) == 3
    assert dp_rank_of(None) == 0


# ---------------------------------------------------------------- the mixin over an old-layout stub scheduler
class OldLayoutBase:
    """The shape of a vLLM ~0.18 scheduler: ``waiting`` + ``skipped_waiting``, no hook methods."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.waiting: deque[Any] = deque()
        self.skipped_waiting: deque[Any] = deque()
        self.running: list[Any] = []

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> Any:
        return SimpleNamespace(
            total_num_scheduled_tokens=0,
            num_scheduled_tokens={},
            scheduled_new_reqs=[],
            scheduled_spec_decode_tokens={},
        )

    def update_from_output(self, out: Any, mro: Any) -> dict:
        return {}

    def has_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        pass


class OldLayoutScheduler(FpmInstrumentation, OldLayoutBase):
    def __init__(self) -> None:
        super().__init__()
        self._fpm_setup(OldLayoutBase, OldStatus)

    def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
        return ListPublisher()


class NoQueuesBase(OldLayoutBase):
    def __init__(self) -> None:
        super().__init__()
        del self.waiting, self.skipped_waiting


class NoQueuesScheduler(FpmInstrumentation, NoQueuesBase):
    def __init__(self) -> None:
        super().__init__()
        self._fpm_setup(NoQueuesBase, OldStatus)


def test_old_layout_is_scanned_and_skipped_waiting_counted() -> None:
    with fpm_env(DYN_FPM_WORKER_ID="old", DYN_FPM_SNAPSHOT_INTERVAL="0.01"):
        sched = OldLayoutScheduler()
    assert sched.fpm_mode == "scan"  # no hook methods on this base: exact full scans
    sched.add_request(req("w", OldStatus.WAITING, 0, 30))
    parked = req("p", OldStatus.WAITING_FOR_REMOTE_KVS, 63, 64)
    sched.requests["p"] = parked
    sched.skipped_waiting.append(parked)
    sched.skipped_waiting.append(sched.requests["w"])  # also in `waiting`: counted once
    out = sched.schedule()
    sched.update_from_output(out, None)
    rec = sched._fpm_pub.records[-1]
    assert rec.wall_time == 0.0 and rec.worker_id == "old"
    assert sched._fpm_pub.handovers == [1]  # the snapshot is handed to the sender before the next step
    q = rec.queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (1, 30)
    assert (q.num_decode_requests, q.sum_decode_kv_tokens, q.num_decode_kv_transfer_requests) == (1, 63, 1)


def test_self_check_refuses_to_publish_without_waiting_containers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR), fpm_env(DYN_FPM_WORKER_ID="x"):
        sched = NoQueuesScheduler()
    assert sched.fpm_mode == "off" and sched._fpm_pub is None
    assert any("FORWARD-PASS METRICS DISABLED" in r.getMessage() for r in caplog.records)


def test_unknown_status_is_an_explicit_counted_fallback(caplog: pytest.LogCaptureFixture) -> None:
    class FutureScheduler(FpmInstrumentation, OldLayoutBase):
        def __init__(self) -> None:
            super().__init__()
            self._fpm_setup(OldLayoutBase, FutureStatus)

        def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
            return ListPublisher()

    with caplog.at_level(logging.WARNING), fpm_env(DYN_FPM_WORKER_ID="f", DYN_FPM_SNAPSHOT_INTERVAL="0.01"):
        sched = FutureScheduler()
        assert any("WAITING_FOR_ENCODER_CACHE" in r.getMessage() for r in caplog.records)  # startup warning
        for i in range(2):
            sched.add_request(req(f"e{i}", FutureStatus.WAITING_FOR_ENCODER_CACHE, 0, 9))
        caplog.clear()
        for _ in range(3):
            sched.update_from_output(sched.schedule(), None)
            sched._fpm_last_publish = 0.0
    assert sched.fpm_mode == "scan"
    q = sched._fpm_pub.records[-1].queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (2, 18)
    assert sched.fpm_counters()["unknown_status"] >= 2
    logged = [r for r in caplog.records if "WAITING_FOR_ENCODER_CACHE" in r.getMessage()]
    assert len(logged) == 1  # once per status, not per request or per record


def test_disabled_by_env_publishes_nothing() -> None:
    with fpm_env(DYN_FPM_ENABLED="0"):
        sched = OldLayoutScheduler()
    assert sched.fpm_mode == "off" and sched._fpm_pub is None
    sched.add_request(req("w", OldStatus.WAITING))
    sched.update_from_output(sched.schedule(), None)


def test_scheduled_summary_rules_and_old_cached_layout() -> None:
    """Per-request scheduled rules on stub outputs, in the old layout (flags, no num_output_tokens)."""
    from dynamo.vllm.fpm_accounting import summarize_scheduled

    def r(prompt: int, outputs: int, preemptions: int = 0) -> SimpleNamespace:
        return SimpleNamespace(
            num_prompt_tokens=prompt,
            num_tokens=prompt + outputs,
            num_output_tokens=outputs,
            num_preemptions=preemptions,
        )

    requests = {
        "new": r(30, 0),
        "arrived": r(64, 0),
        "chunk": r(100, 0),
        "dec": r(20, 5),
        "resumed": r(40, 10, preemptions=1),
    }
    out = SimpleNamespace(
        num_scheduled_tokens={"new": 30, "arrived": 1, "chunk": 36, "dec": 1, "resumed": 50},
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[
            SimpleNamespace(req_id="new", num_computed_tokens=0),
            SimpleNamespace(req_id="arrived", num_computed_tokens=63),
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["chunk", "dec", "resumed"],
            num_computed_tokens=[64, 24, 0],
            resumed_from_preemption=[False, False, True],
        ),
    )
    arrived = {"arrived"}
    s = summarize_scheduled(out, requests, arrived)
    assert arrived == set()  # consumed by its first scheduling
    # Prefill: new (30 tokens), chunk continuation (36, reads 64), resumed recompute (50, length 50).
    assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (3, 30 + 36 + 50, 64)
    lengths = [30, 100, 50]
    mean = sum(lengths) / 3
    assert s.var_prefill_length == pytest.approx(sum((x - mean) ** 2 for x in lengths) / 3)
    # Decode: the KV-arrived request computing its last prompt token, and the running decode.
    assert (s.num_decode_requests, s.sum_decode_kv_tokens) == (2, 63 + 24)
    assert s.var_decode_kv_tokens == pytest.approx(((63 - 43.5) ** 2 + (24 - 43.5) ** 2) / 2)
