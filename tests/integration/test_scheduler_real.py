"""InstrumentedScheduler on the real vLLM scheduler: every queued class reached through real transitions.

No model runs: the tests play the model runner (one sampled token per scheduled request, none
mid-prefill) and, for async KV loads, the worker-side connector (``finished_recving``). Records are
captured in memory here; test_scheduler_nats.py reads them back from a real NATS server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.forward_pass_metrics import is_heartbeat
from dynamo_fpm_testing.scheduler_support import (
    SchedSpec,
    capturing_scheduler_cls,
    fpm_env,
    has_inflight_kv_loads,
    make_request,
    make_scheduler,
    model_output,
    prefill_done_output,
    step,
    write_model_config,
)

pytestmark = pytest.mark.vllm

TEST_CONNECTOR: dict[str, Any] = {
    "kv_connector": "AsyncLoadTestConnector",
    "kv_connector_module_path": "dynamo_fpm_testing.kv_connectors",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("sched-model"))


@pytest.fixture()
def build(model_dir: Path) -> Any:
    made: list[Any] = []

    def _build(**kwargs: Any) -> Any:
        with fpm_env(DYN_FPM_WORKER_ID="w-test", DYN_FPM_AUDIT_INTERVAL="0"):
            sched = make_scheduler(capturing_scheduler_cls(), SchedSpec(model_dir, **kwargs))
        assert sched.fpm_mode == "incremental"
        made.append(sched)
        return sched

    yield _build
    for sched in made:
        sched.shutdown()


def exact(sched: Any) -> Any:
    """The incremental queued metrics, asserted equal to a full scan of the waiting containers."""
    inc = sched.fpm_queued_metrics()
    assert inc == sched.fpm_scan_queued()
    return inc


def records(sched: Any) -> list[Any]:
    return sched._fpm_pub.records


def status_of(sched: Any, name: str) -> list[Any]:
    return [r for r in sched.requests.values() if r.status.name == name]


def test_budget_overflow_queues_prefill_and_chunks(build: Any) -> None:
    sched = build(max_num_batched_tokens=64)
    for _ in range(4):
        sched.add_request(make_request(40, 4))
    step(sched)
    rec = records(sched)[-1]
    s = rec.scheduled_requests
    # 40 tokens of req0 and a 24-token chunk of req1; req2/req3 wait.
    assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (2, 64, 0)
    assert s.var_prefill_length == 0.0 and s.num_decode_requests == 0
    q = rec.queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens, q.num_decode_requests) == (2, 80, 0)
    assert rec.wall_time > 0.0
    step(sched)
    s = records(sched)[-1].scheduled_requests
    # req0 decodes on 40 KV tokens; req1's last 16-token chunk reads its first 24; req2 takes 40
    # and req3 a 7-token chunk of the remaining budget.
    assert (s.num_decode_requests, s.sum_decode_kv_tokens) == (1, 40)
    assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (3, 16 + 40 + 7, 24)
    assert exact(sched).num_prefill_requests == 0


def test_async_kv_parked_then_ready_then_promoted_as_decode(build: Any) -> None:
    sched = build(**TEST_CONNECTOR)
    local = make_request(30, 8)
    remote = [make_request(n, 8, remote_prefill=True) for n in (64, 80, 96)]
    sched.add_request(local)
    for r in remote:
        sched.add_request(r)
    step(sched)
    assert len(status_of(sched, "WAITING_FOR_REMOTE_KVS")) == 3
    q = records(sched)[-1].queued_requests
    assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (3, 63 + 79 + 95)
    assert (q.num_decode_kv_transfer_requests, q.sum_decode_kv_transfer_tokens) == (3, 63 + 79 + 95)
    assert (q.num_decode_kv_ready_requests, q.num_prefill_requests) == (0, 0)
    assert q.var_decode_kv_tokens == pytest.approx(((63 - 79) ** 2 + 0 + (95 - 79) ** 2) / 3)

    # The worker side reports two transfers done: they are "ready", the third still in flight.
    step(sched, finished_recving=[remote[0].request_id, remote[1].request_id])
    q = exact(sched)
    assert (q.num_decode_kv_ready_requests, q.sum_decode_kv_ready_tokens) == (2, 63 + 79)
    assert (q.num_decode_kv_transfer_requests, q.sum_decode_kv_transfer_tokens) == (1, 95)
    assert records(sched)[-1].queued_requests == q

    # Next pass promotes and schedules them: on a decode engine that is decode work, not prefill.
    step(sched)
    s = records(sched)[-1].scheduled_requests
    assert (s.num_prefill_requests, s.sum_prefill_tokens) == (0, 0)
    assert (s.num_decode_requests, s.sum_decode_kv_tokens) == (3, 31 + 63 + 79)
    q = exact(sched)
    assert (q.num_decode_requests, q.num_decode_kv_transfer_requests, q.num_decode_kv_ready_requests) == (
        1,
        1,
        0,
    )


def test_a_remote_prefill_waiting_for_a_decode_slot_is_queued_decode(build: Any) -> None:
    """A decode engine's remote-prefill request whose KV pull has not started (the batch is full) waits as
    ``WAITING``: its prefill runs elsewhere, so it is queued decode with the context it will hold, in neither
    the transfer nor the ready part; once its pull starts it is a transfer."""
    sched = build(max_num_seqs=1, **TEST_CONNECTOR)
    local = make_request(30, 200)
    sched.add_request(local)
    step(sched)
    remote = [make_request(n, 8, remote_prefill=True) for n in (64, 80)]
    for r in remote:
        sched.add_request(r)
    step(sched)
    assert [r.status.name for r in remote] == ["WAITING", "WAITING"]
    q = records(sched)[-1].queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (0, 0)
    assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (2, 64 + 80)
    assert q.var_decode_kv_tokens == pytest.approx(64.0)
    assert (q.num_decode_kv_transfer_requests, q.num_decode_kv_ready_requests) == (0, 0)
    assert q == exact(sched)

    # The slot frees: both pulls start (decode transfer, KV = what is being loaded).
    sched.finish_requests(local.request_id, local.status.__class__.FINISHED_ABORTED)
    step(sched)
    assert [r.status.name for r in remote] == ["WAITING_FOR_REMOTE_KVS"] * 2
    q = exact(sched)
    assert (q.num_decode_requests, q.num_decode_kv_transfer_requests, q.sum_decode_kv_transfer_tokens) == (
        2,
        2,
        63 + 79,
    )
    assert q.num_prefill_requests == 0


@pytest.mark.skipif(not has_inflight_kv_loads(), reason="vLLM < 0.34 has no --max-num-inflight-kv-loads")
def test_inflight_kv_loads_cap_parks_pulls_in_async_kv_waiting_as_queued_decode(build: Any) -> None:
    """vLLM 0.34 with ``--max-num-inflight-kv-loads 1``: remote-prefill requests whose pull the cap holds back
    wait in ``async_kv_waiting`` (status ``WAITING``); they are scanned and counted as queued decode."""
    sched = build(max_num_seqs=1, max_num_inflight_kv_loads=1, **TEST_CONNECTOR)
    assert "async_kv_waiting" in sched._fpm.container_names
    local = make_request(30, 200)
    sched.add_request(local)
    step(sched)
    remote = [make_request(n, 8, remote_prefill=True) for n in (64, 80, 96)]
    for r in remote:
        sched.add_request(r)
    assert len(sched.async_kv_waiting) == 3
    step(sched)  # the batch is full, yet one pull starts (the cap is 1); two wait in async_kv_waiting
    assert [r.status.name for r in remote] == ["WAITING_FOR_REMOTE_KVS", "WAITING", "WAITING"]
    assert {r.request_id for r in sched.async_kv_waiting} == {remote[1].request_id, remote[2].request_id}
    q = records(sched)[-1].queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (0, 0)
    assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (3, 63 + 80 + 96)
    assert (q.num_decode_kv_transfer_requests, q.sum_decode_kv_transfer_tokens) == (1, 63)
    assert q.num_decode_kv_ready_requests == 0
    assert q == exact(sched)
    # Negative control: the scan of the two queues vLLM 0.32 has misses both waiting pulls.
    from dynamo.vllm.fpm_classifier import scan_containers

    s = sched._fpm
    old = scan_containers(
        [sched.kv_holding_waiting, sched.waiting], s.kinds, set(), s.kv_arrived, s.pull_pending
    ).totals.metrics()
    assert (old.num_decode_requests, old.num_decode_kv_transfer_requests) == (1, 1)

    # The first pull ends: it is ready (it still needs the slot), and the cap still holds the others back.
    step(sched, finished_recving=[remote[0].request_id])
    q = exact(sched)
    assert (q.num_decode_requests, q.num_decode_kv_ready_requests, q.num_prefill_requests) == (3, 1, 0)
    for _ in range(3):
        step(sched)
        exact(sched)
        # An audit (the incremental entries against a full scan) finds nothing to repair: before the scan
        # read async_kv_waiting, every audit here "repaired" its requests away.
        assert len(sched.async_kv_waiting) == 2
        assert sched._fpm.audit(sched, sched._fpm.q)
    assert (sched.fpm_counters()["audits"], sched.fpm_counters()["audit_mismatches"]) == (3, 0)


def test_nixl_connector_scheduler_side_parks_requests(build: Any) -> None:
    sched = build(kv_connector="NixlConnector")
    parked = [make_request(n, 8, remote_prefill=True) for n in (48, 100)]
    for r in parked:
        sched.add_request(r)
    for _ in range(3):
        out, _ = step(sched)
        assert out.total_num_scheduled_tokens == 0  # nothing can run: all wait for their KV
    assert len(status_of(sched, "WAITING_FOR_REMOTE_KVS")) == 2
    q = exact(sched)
    kv = sum(r.num_computed_tokens for r in parked)
    assert kv > 0
    assert (q.num_decode_requests, q.sum_decode_kv_tokens, q.num_decode_kv_transfer_requests) == (2, kv, 2)
    assert q.num_prefill_requests == 0


def test_real_recompute_preemption_reports_context_kv_then_prefill(build: Any) -> None:
    # 10 blocks of 16 tokens: three requests outgrow the cache and vLLM preempts by recompute.
    sched = build(num_blocks=10, max_num_batched_tokens=512)
    for _ in range(3):
        sched.add_request(make_request(40, 60))
    preempted_seen: list[tuple[Any, int]] = []
    for _ in range(120):
        step(sched)
        q = exact(sched)
        now = status_of(sched, "PREEMPTED")
        if now:
            assert all(r.num_computed_tokens == 0 for r in now)  # vLLM reset it
            kv = sum(r.num_tokens for r in now)
            assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (len(now), kv)
            assert records(sched)[-1].queued_requests.sum_decode_kv_tokens == kv > 0
            preempted_seen.append((now[0], now[0].num_tokens))
            break
    assert preempted_seen, "no preemption happened"
    victim, context = preempted_seen[0]
    # Step until the victim runs again: that pass recomputes its context, reported as prefill.
    for _ in range(200):
        before = len(records(sched))
        out, _ = step(sched)
        if victim.request_id in out.num_scheduled_tokens and len(records(sched)) > before:
            s = records(sched)[-1].scheduled_requests
            assert s.num_prefill_requests >= 1
            assert s.sum_prefill_tokens + s.sum_prefill_kv_tokens >= context
            break
        if not any(victim is r for r in status_of(sched, "PREEMPTED")):
            pytest.fail("victim left the queue without being scheduled")
    else:
        pytest.fail("victim never resumed")


def test_structured_output_request_waits_for_grammar_as_prefill(build: Any) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sched = build()
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    grammar_req = make_request(25, sampling_params=params)
    assert grammar_req.status.name == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    plain = make_request(10, 8)
    sched.add_request(grammar_req)
    sched.add_request(plain)
    for _ in range(3):
        out, _ = step(sched)
        assert grammar_req.request_id not in out.num_scheduled_tokens  # grammar never compiled
    q = records(sched)[-1].queued_requests
    assert (q.num_prefill_requests, q.sum_prefill_tokens, q.num_decode_requests) == (1, 25, 0)
    assert exact(sched) == q


def test_async_call_order_two_schedules_before_update(build: Any) -> None:
    sched = build()
    reqs = [make_request(n, 6) for n in (20, 30, 40)]
    for r in reqs:
        sched.add_request(r)
    out1 = sched.schedule()
    time.sleep(0.02)  # batch 1 "executing"
    out2 = sched.schedule()  # scheduled while batch 1 runs (placeholders)
    assert out2.total_num_scheduled_tokens == 3
    time.sleep(0.03)
    sched.update_from_output(out1, prefill_done_output(sched, out1))
    time.sleep(0.03)
    sched.update_from_output(out2, model_output(out2))
    r1, r2 = records(sched)[-2:]
    assert (r1.scheduled_requests.num_prefill_requests, r1.scheduled_requests.sum_prefill_tokens) == (3, 90)
    assert r1.scheduled_requests.num_decode_requests == 0
    s2 = r2.scheduled_requests
    assert (s2.num_prefill_requests, s2.num_decode_requests, s2.sum_decode_kv_tokens) == (0, 3, 90)
    # wall_time: batch 1 from its dispatch, batch 2 from batch 1's completion (not its own dispatch).
    assert 0.045 <= r1.wall_time < 0.2
    assert 0.025 <= r2.wall_time < 0.1
    exact(sched)


def test_sync_order_token_sums_match_every_batch(build: Any) -> None:
    sched = build(max_num_batched_tokens=48, max_num_seqs=8)
    lens = [17, 33, 50, 8]
    for n in lens:
        sched.add_request(make_request(n, 5))
    computed = 0
    while sched.has_requests():  # as the engine loop does
        before = len(records(sched))
        out, _ = step(sched)
        if out.total_num_scheduled_tokens:
            s = records(sched)[before].scheduled_requests
            assert s.sum_prefill_tokens + s.num_decode_requests == out.total_num_scheduled_tokens
            computed += out.total_num_scheduled_tokens
        exact(sched)
    # Every prompt token once, then one token per further output token (the last one is never fed back).
    assert computed == sum(lens) + len(lens) * (5 - 1)
    assert sched._fpm_pub.idle_record is not None and sched._fpm_idle  # heartbeat resumes when idle


def test_idle_record_suspended_while_requests_exist(build: Any) -> None:
    sched = build()
    pub = sched._fpm_pub
    sched.add_request(make_request(12, 2))
    assert pub.idle_record is None  # suspended the moment work arrives, before any pass
    step(sched)
    assert pub.idle_record is None
    while sched.has_requests():  # as the engine loop does
        step(sched)
    idle = pub.idle_record
    assert idle is not None and idle.wall_time == 0.0 and idle.worker_id == "w-test"
    assert idle.queued_requests.num_prefill_requests == idle.queued_requests.num_decode_requests == 0


def test_abort_of_queued_and_parked_requests_leaves_exact_totals(build: Any) -> None:
    from vllm.v1.request import RequestStatus

    sched = build(max_num_seqs=2, **TEST_CONNECTOR)
    reqs = [make_request(20, 50) for _ in range(3)] + [
        make_request(40, 9, remote_prefill=True) for _ in range(2)
    ]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    step(sched)
    sched.finish_requests([reqs[2].request_id, reqs[3].request_id], RequestStatus.FINISHED_ABORTED)
    q = exact(sched)
    assert q.num_prefill_requests + q.num_decode_requests == len(sched.requests) - len(sched.running)


# ---------------------------------------------------------------- drift guard
def _request_containers(sched: Any) -> dict[str, set[str]]:
    from vllm.v1.request import Request

    found: dict[str, set[str]] = {}
    for name, value in vars(sched).items():
        items: Any = None
        if isinstance(value, dict):
            items = [*value, *value.values()]  # dict[str, Request] or dict[Request, int]
        elif hasattr(value, "__iter__") and not isinstance(value, str | bytes):
            try:
                items = list(value)
            except Exception:
                continue
        if items is None:
            continue
        ids = {r.request_id for r in items if isinstance(r, Request)}
        if ids:
            found[name] = ids
    return found


def test_drift_guard_waiting_requests_live_only_where_the_classifier_looks(build: Any) -> None:
    """Fails when vLLM starts keeping waiting requests in a container the classifier does not scan."""
    from dynamo.vllm.fpm_classifier import KNOWN_CONTAINER_NAMES, KNOWN_WAITING_CONTAINERS, Kind

    sched = build(num_blocks=14, max_num_seqs=3, max_num_batched_tokens=64, **TEST_CONNECTOR)
    for i in range(2):
        sched.add_request(make_request(50 + i, 5, remote_prefill=True))
    for i in range(4):
        sched.add_request(make_request(30 + i, 60))
    seen_statuses: set[str] = set()
    for i in range(40):
        parked = [r.request_id for r in status_of(sched, "WAITING_FOR_REMOTE_KVS")]
        step(sched, finished_recving=parked[:1] if i % 3 == 2 else ())
        seen_statuses |= {r.status.name for r in sched.requests.values()}
        containers = _request_containers(sched)
        unknown = set(containers) - KNOWN_CONTAINER_NAMES
        assert not unknown, f"requests held in containers the FPM classifier does not know: {unknown}"
        in_queues = set().union(*(containers.get(n, set()) for n in KNOWN_WAITING_CONTAINERS))
        by_status = {
            rid for rid, r in sched.requests.items() if sched._fpm_kinds[r.status] is not Kind.NOT_QUEUED
        }
        assert in_queues == by_status, "a waiting request is outside the scanned containers (or vice versa)"
        exact(sched)
    assert {"PREEMPTED", "WAITING_FOR_REMOTE_KVS", "WAITING", "RUNNING"} <= seen_statuses


# ---------------------------------------------------------------- audit and scan mode
def test_audit_detects_and_repairs_a_missed_change(model_dir: Path) -> None:
    """Negative control for the safety net: a hook that misses preemptions drifts; the audit repairs it."""
    from dynamo.vllm.instrumented_scheduler import FpmInstrumentation

    # A base class made at run time (vLLM's scheduler with the mixin): mypy can check neither it nor the
    # super() call that skips the mixin's hook on purpose.
    class Blind(capturing_scheduler_cls()):  # type: ignore[misc]
        def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
            super(FpmInstrumentation, self)._preempt_request(request, *args, **kwargs)  # type: ignore[misc]

    with fpm_env(DYN_FPM_WORKER_ID="blind", DYN_FPM_AUDIT_INTERVAL="0.000001"):
        sched = make_scheduler(Blind, SchedSpec(model_dir, num_blocks=10, max_num_batched_tokens=512))
    try:
        for _ in range(3):
            sched.add_request(make_request(40, 60))
        for _ in range(120):
            step(sched)
            if sched.fpm_counters()["audit_mismatches"]:
                break
        assert sched.fpm_counters()["audit_mismatches"] >= 1
        # Every published record was audited (interval ~0), so each one carries the repaired totals.
        assert records(sched)[-1].queued_requests == sched.fpm_scan_queued()
    finally:
        sched.shutdown()


def test_scan_mode_publishes_the_same_records_as_incremental(model_dir: Path) -> None:
    """The two accounting modes, fed the same workload in lockstep, publish identical records."""
    made = {}
    for mode in ("scan", "incremental"):
        with fpm_env(DYN_FPM_WORKER_ID="w", DYN_FPM_QUEUE_ACCOUNTING=mode, DYN_FPM_AUDIT_INTERVAL="0"):
            made[mode] = make_scheduler(
                capturing_scheduler_cls(), SchedSpec(model_dir, num_blocks=10, **TEST_CONNECTOR)
            )
    try:
        assert [s.fpm_mode for s in made.values()] == ["scan", "incremental"]
        for sched in made.values():
            sched.add_request(make_request(50, 4, remote_prefill=True, seed_token=1))
            for i in range(3):
                sched.add_request(make_request(40, 60, seed_token=10 + i))
        for i in range(40):
            for sched in made.values():
                parked = [r.request_id for r in status_of(sched, "WAITING_FOR_REMOTE_KVS")]
                step(sched, finished_recving=parked if i == 5 else ())
        scan, inc = (records(s) for s in made.values())
        strip = [(r.scheduled_requests, r.queued_requests) for r in scan]
        assert strip == [(r.scheduled_requests, r.queued_requests) for r in inc]
        assert any(r.queued_requests.num_decode_kv_transfer_requests for r in scan)
        assert any(
            r.queued_requests.num_decode_requests > r.queued_requests.num_decode_kv_transfer_requests
            for r in scan
        )
    finally:
        for sched in made.values():
            sched.shutdown()


def test_a_prefill_engine_counts_the_kv_it_holds_for_decode_workers(build: Any) -> None:
    """NixlConnector (producer side) keeps a finished prefill request's blocks until the decode side has read
    them: the scheduler publishes how many such hand-offs are open (the worker's drain waits on it)."""
    from dynamo.vllm.fpm_env import STAT_KV_PINNED
    from vllm.v1.outputs import KVConnectorOutput

    sched = build(kv_connector="NixlConnector", kv_role="kv_producer")
    sched._fpm_pub.extra_stats = {}  # the stats-file figures of FpmDirectPublisher
    req = make_request(70, max_tokens=1)
    req.sampling_params.extra_args = {"kv_transfer_params": {"do_remote_decode": True}}
    req.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(req)
    step(sched)
    assert req.is_finished() and req.request_id in sched.requests  # its blocks are held for the decode side
    assert sched._fpm_pub.extra_stats[STAT_KV_PINNED] == 1
    # The record of the pass that finished it already carries the held KV (the planner's view of it).
    held = records(sched)[-1]
    assert (held.num_held_kv_requests, held.sum_held_kv_tokens) == (1, 70)
    assert held.max_held_kv_age is not None and 0.0 <= held.max_held_kv_age < 1.0
    assert not is_heartbeat(held)
    time.sleep(0.05)
    sched._fpm.last_publish = 0.0  # a snapshot is due: the engine steps with nothing to run while it holds KV
    out = sched.schedule()
    sched.update_from_output(out, model_output(out))
    aged = records(sched)[-1]
    assert aged.wall_time == 0.0 and aged.num_held_kv_requests == 1
    assert aged.max_held_kv_age is not None and aged.max_held_kv_age >= held.max_held_kv_age + 0.05
    out = sched.schedule()
    mro = model_output(out)
    mro.kv_connector_output = KVConnectorOutput(finished_sending={req.request_id})
    sched.update_from_output(out, mro)
    assert req.request_id not in sched.requests
    assert sched._fpm_pub.extra_stats[STAT_KV_PINNED] == 0
    # Released: the engine is idle and its idle record says nothing is held (0, not None: it is tracked).
    idle = sched._fpm_pub.idle_record
    assert idle is not None and is_heartbeat(idle)
    assert (idle.num_held_kv_requests, idle.sum_held_kv_tokens, idle.max_held_kv_age) == (0, 0, 0.0)


def test_an_engine_without_a_kv_connector_leaves_the_held_kv_fields_out(build: Any) -> None:
    sched = build()
    sched.add_request(make_request(40, max_tokens=1))
    step(sched)
    assert records(sched)
    assert all(r.num_held_kv_requests is None and r.max_held_kv_age is None for r in records(sched))
