"""The table of hooked vLLM methods (``fpm_hooks``) and the startup check that reads it.

A vLLM release that renames a hooked method leaves our override uncalled; the scheduler must notice when it
is built (full scans from the first record, one warning), not at the next audit.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dynamo.vllm.fpm_hooks import HOOKED_METHODS, HOOKED_NAMES, Role, check_hooks
from dynamo.vllm.instrumented_scheduler import FpmInstrumentation
from dynamo_fpm_testing.scheduler_support import (
    ListPublisher,
    SchedSpec,
    fpm_env,
    make_request,
    make_scheduler,
    step,
    write_model_config,
)

TEST_CONNECTOR: dict[str, Any] = {
    "kv_connector": "AsyncLoadTestConnector",
    "kv_connector_module_path": "dynamo_fpm_testing.kv_connectors",
}


# ---------------------------------------------------------------- the table itself
def test_every_hooked_method_has_a_role_and_is_listed_once() -> None:
    assert len(HOOKED_NAMES) == len(HOOKED_METHODS)
    assert all(hook.roles for hook in HOOKED_METHODS)
    assert {role for hook in HOOKED_METHODS for role in hook.roles} == set(Role)


@pytest.mark.vllm
def test_the_table_is_every_vllm_method_the_mixin_overrides() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    overridden = {
        name
        for name, value in vars(FpmInstrumentation).items()
        if callable(value) and hasattr(Scheduler, name)
    }
    assert overridden == HOOKED_NAMES
    assert check_hooks(Scheduler).missing == ()  # this vLLM has every one


def test_the_check_degrades_by_role() -> None:
    def present(self: Any) -> None:
        pass

    class Base:
        schedule = update_from_output = add_request = shutdown = present

    check = check_hooks(Base)
    assert check.can_publish and not check.incremental_ok and not check.fast_path_ok
    assert "_preempt_request" in check.lacks(Role.PREEMPTION)
    assert check.lacks(Role.KV_ARRIVAL) == ["_handle_blocked_waiting_request"]
    assert any(loss.startswith("queue (") for loss in check.losses())
    Base.update_from_output = None  # type: ignore[assignment]
    assert check_hooks(Base).lacks(Role.RECORD) == ["update_from_output"]
    assert not check_hooks(Base).can_publish


# ---------------------------------------------------------------- stub bases
class Status(enum.IntEnum):
    WAITING = 1
    RUNNING = 2


class StubBase:
    """Every hooked method present (no-ops), one waiting container."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.waiting: list[Any] = []

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> Any:
        return SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})

    def update_from_output(self, out: Any, mro: Any) -> dict:
        return {}

    def has_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        pass


for _name in HOOKED_NAMES - set(vars(StubBase)):
    setattr(StubBase, _name, lambda self, *a, **k: None)


def stub_scheduler(**missing: None) -> Any:
    """A mixin scheduler over a copy of StubBase whose named methods are missing (set to None)."""
    base = type("Base", (StubBase,), dict(missing))

    class Sched(FpmInstrumentation, base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._fpm_setup(status_enum=Status)  # base: the class after the mixin

        def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
            return ListPublisher()

    return Sched()


def test_a_complete_base_is_incremental_with_one_name_on_the_instance() -> None:
    with fpm_env(DYN_FPM_WORKER_ID="stub"):
        sched = stub_scheduler()
    assert sched.fpm_mode == "incremental" and sched._fpm.fast_path
    assert [name for name in vars(sched) if name.startswith("_fpm")] == ["_fpm"]


def test_a_missing_preemption_hook_turns_the_fast_path_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), fpm_env(DYN_FPM_WORKER_ID="stub"):
        sched = stub_scheduler(_preempt_request=None)
    assert sched.fpm_mode == "scan" and not sched._fpm.fast_path
    (warning,) = [r.getMessage() for r in caplog.records if "_preempt_request" in r.getMessage()]
    assert "full scan" in warning and "preemption" in warning


def test_a_missing_record_hook_refuses_to_publish(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR), fpm_env(DYN_FPM_WORKER_ID="stub"):
        sched = stub_scheduler(update_from_output=None)
    assert sched.fpm_mode == "off" and sched._fpm_pub is None
    assert any(
        "FORWARD-PASS METRICS DISABLED" in r.getMessage() and "update_from_output" in r.getMessage()
        for r in caplog.records
    )


def test_a_forced_incremental_mode_without_hooks_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING),
        fpm_env(DYN_FPM_WORKER_ID="stub", DYN_FPM_QUEUE_ACCOUNTING="incremental"),
    ):
        sched = stub_scheduler(_enqueue_waiting_request=None)
    assert sched.fpm_mode == "scan"
    assert any("cannot be honoured" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- a real vLLM scheduler missing a method
def _capturing(base: type) -> type:
    """The FPM mixin over a vLLM scheduler class (a new release's stand-in), publishing to a ListPublisher."""

    class Capturing(FpmInstrumentation, base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._fpm_setup()

        def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
            return ListPublisher()

    return Capturing


@pytest.mark.vllm
def test_a_renamed_vllm_method_switches_to_full_scans_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's AsyncScheduler as if a release renamed ``_update_request_as_session``: from the first record on,
    every record is a full scan (no audit needed: audits are off here), and it was said once, at start."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class RenamedBase(AsyncScheduler):
        # Nothing would call our hook of that name any more (a deliberate clash with the mixin's signature).
        _update_request_as_session = None

    Renamed = _capturing(RenamedBase)  # the mixin over the renamed base

    model_dir = write_model_config(tmp_path)
    with caplog.at_level(logging.WARNING), fpm_env(DYN_FPM_WORKER_ID="renamed", DYN_FPM_AUDIT_INTERVAL="0"):
        sched = make_scheduler(
            Renamed, SchedSpec(model_dir, num_blocks=10, max_num_batched_tokens=512, **TEST_CONNECTOR)
        )
    try:
        assert sched.fpm_mode == "scan"  # at start, before any record
        startup = [r for r in caplog.records if "_update_request_as_session" in r.getMessage()]
        assert len(startup) == 1 and "full scan" in startup[0].getMessage()
        caplog.clear()
        sched.add_request(make_request(50, 4, remote_prefill=True, seed_token=1))
        for i in range(3):
            sched.add_request(make_request(40, 60, seed_token=10 + i))  # outgrow 10 blocks: preemptions
        preempted = published = 0
        for i in range(80):
            parked = [
                r.request_id for r in sched.requests.values() if r.status.name == "WAITING_FOR_REMOTE_KVS"
            ]
            before = len(sched._fpm_pub.records)
            step(sched, finished_recving=parked if i == 5 else ())
            preempted += any(r.status.name == "PREEMPTED" for r in sched.requests.values())
            if len(sched._fpm_pub.records) > before:  # this step published: a full scan of this moment
                published += 1
                assert sched._fpm_pub.records[-1].queued_requests == sched.fpm_scan_queued()
        assert published > 40
        assert preempted
        assert sched.fpm_counters()["audits"] == 0
        assert not [r for r in caplog.records if "_update_request_as_session" in r.getMessage()]
    finally:
        sched.shutdown()


# ---------------------------------------------------------------- the drift guard: a queue nobody listed
@pytest.mark.vllm
def test_an_unknown_request_queue_is_named_once_and_every_record_equals_a_full_scan_over_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM release that adds a waiting queue, played by a subclass of vLLM's AsyncScheduler that holds
    every ``held-`` request in a queue of its own and lets one go per ``schedule()``. The scheduler finds the
    queue when it is built, names it in one warning, and every record equals a full scan over every
    container that holds requests (the known waiting queues and the new one)."""
    from dynamo.vllm.fpm_classifier import KNOWN_WAITING_CONTAINERS, scan_containers
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.request_queue import create_request_queue

    class NewQueueBase(AsyncScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.held_waiting = create_request_queue(self.policy)

        def _enqueue_waiting_request(self, request: Any) -> None:
            if request.request_id.startswith("held-") and request.num_computed_tokens == 0:
                self.held_waiting.add_request(request)
            else:
                super()._enqueue_waiting_request(request)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if self.held_waiting:
                self.waiting.add_request(self.held_waiting.pop_request())
            return super().schedule(*args, **kwargs)

    NewQueue = _capturing(NewQueueBase)

    model_dir = write_model_config(tmp_path)
    with caplog.at_level(logging.WARNING), fpm_env(DYN_FPM_WORKER_ID="newq", DYN_FPM_AUDIT_INTERVAL="0"):
        sched = make_scheduler(
            NewQueue, SchedSpec(model_dir, max_num_seqs=2, max_num_batched_tokens=64, **TEST_CONNECTOR)
        )
    try:
        assert sched.fpm_mode == "scan"  # at start, before any record
        named = [r for r in caplog.records if "held_waiting" in r.getMessage()]
        assert len(named) == 1 and "full scan" in named[0].getMessage()
        assert sched.fpm_counters()["unknown_containers"] == 1
        caplog.clear()
        s = sched._fpm
        every_container = [*KNOWN_WAITING_CONTAINERS, "held_waiting"]

        def full_scan(names: list[str]) -> Any:
            containers = [getattr(sched, n) for n in names if hasattr(sched, n)]
            ready = sched.finished_recving_kv_req_ids
            return scan_containers(containers, s.kinds, ready, s.kv_arrived, s.pull_pending).totals.metrics()

        for i in range(4):
            sched.add_request(make_request(30 + i, 6, request_id=f"held-{i}"))
            sched.add_request(make_request(20 + i, 6))
        sched.add_request(make_request(40, 6, request_id="held-remote", remote_prefill=True))
        published = missed_by_known = 0
        reported: set[str] = set()  # KV loads the test (the worker side) has reported done
        for _ in range(40):
            before = len(sched._fpm_pub.records)
            parked = {rid for rid, r in sched.requests.items() if r.status.name == "WAITING_FOR_REMOTE_KVS"}
            step(sched, finished_recving=parked - reported)
            reported |= parked
            if len(sched._fpm_pub.records) > before:
                published += 1
                record = sched._fpm_pub.records[-1].queued_requests
                assert record == full_scan(every_container)
                missed_by_known += record != full_scan(list(KNOWN_WAITING_CONTAINERS))
            if not sched.has_requests():
                break
        assert published > 5
        assert missed_by_known > 0  # the new queue held requests: without the guard the counts were wrong
        assert not sched.requests
        assert not [r for r in caplog.records if "held_waiting" in r.getMessage()]  # said once
    finally:
        sched.shutdown()
