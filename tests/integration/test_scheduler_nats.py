"""Records read back from a real nats-server: the acceptance criteria on the wire.

The scheduler is the real ``InstrumentedScheduler`` with its real ``FpmDirectPublisher``; the tests play
the engine loop (including its fast empty steps) and read records with a plain nats-py subscriber.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from dynamo.common.fpm_subjects import fpm_subject
from dynamo_fpm_testing.scheduler_support import (
    NatsRecords,
    SchedSpec,
    fpm_env,
    make_request,
    make_scheduler,
    model_output,
    prefill_done_output,
    step,
    write_model_config,
)

pytestmark = pytest.mark.vllm


def load_upstream_schema(upstream_dir: Path) -> ModuleType:
    """Upstream's schema module under a private name (it must not shadow ours)."""
    path = upstream_dir / "dynamo" / "common" / "forward_pass_metrics.py"
    spec = importlib.util.spec_from_file_location("upstream_fpm_for_scheduler_tests", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("nats-model"))


@pytest.fixture()
def wired(nats_server: Any, model_dir: Path, tmp_path: Path) -> Any:
    """(make scheduler, subscriber) on a namespace of this test's own."""
    from dynamo.vllm.instrumented_scheduler import InstrumentedScheduler

    ns = f"t{uuid.uuid4().hex[:10]}"
    sub = NatsRecords(nats_server.url, fpm_subject(ns, "backend")).start()
    made: list[Any] = []

    def _make(**kwargs: Any) -> Any:
        with fpm_env(
            NATS_SERVER=nats_server.url,
            DYN_NAMESPACE=ns,
            DYN_FPM_COMPONENT="backend",
            DYN_FPM_WORKER_ID="decode-1",
            DYN_FPM_STATS_FILE=str(tmp_path / "fpm-{dp_rank}.json"),
        ):
            sched = make_scheduler(InstrumentedScheduler, SchedSpec(model_dir, **kwargs))
        made.append(sched)
        return sched

    yield _make, sub
    for sched in made:
        sched.shutdown()
    sub.close()


def test_decode_side_waiting_for_remote_kv_is_reported_within_a_second_and_stays(
    wired: Any, upstream_dir: Path
) -> None:
    make, sub = wired
    sched = make(
        kv_connector="AsyncLoadTestConnector", kv_connector_module_path="dynamo_fpm_testing.kv_connectors"
    )
    # Idle engine first: heartbeats only (identity, all zero).
    assert sub.wait_for(lambda r: r.wall_time == 0.0, timeout=3.0) is not None

    lens = [64, 70, 90, 100, 33]
    reqs = [make_request(n, 16, remote_prefill=True) for n in lens]
    kv = sum(n - 1 for n in lens)
    t0 = time.monotonic()
    for r in reqs:
        sched.add_request(r)

    def wanted(rec: Any) -> bool:
        q = rec.queued_requests
        return q.num_decode_requests == len(lens) and q.sum_decode_kv_tokens == kv

    # The engine loop: empty steps while every request waits for its KV (nothing running).
    first_ok: float | None = None
    samples: list[Any] = []
    while time.monotonic() - t0 < 2.5:
        out, _ = step(sched)
        assert out.total_num_scheduled_tokens == 0
        latest = sub.latest()
        if first_ok is None and latest is not None and wanted(latest):
            first_ok = time.monotonic() - t0
        if first_ok is not None:
            samples.append(latest)
        time.sleep(0.001)
    assert first_ok is not None and first_ok <= 1.0, f"first correct record after {first_ok} s"
    assert samples and all(wanted(r) for r in samples), "latest record stopped reporting the waiting requests"
    recs = sub.snapshot()
    after = recs[next(i for i, r in enumerate(recs) if wanted(r)) :]
    assert len(after) >= 5  # snapshots keep coming (every 0.25 s by default), never zeros
    assert all(wanted(r) and r.wall_time == 0.0 for r in after)
    q = after[-1].queued_requests
    assert (q.num_decode_kv_transfer_requests, q.sum_decode_kv_transfer_tokens) == (5, kv)
    # Rate bound: empty steps spin every ~1 ms, snapshots are at most one per interval.
    assert len(after) <= 2.5 / 0.25 + 2

    # Every record on the wire decodes with upstream Dynamo's own schema.
    up = load_upstream_schema(upstream_dir)
    for payload in list(sub.payloads):
        theirs = up.decode(payload)
        assert theirs is not None and theirs.worker_id == "decode-1"
    last = up.decode(sub.payloads[-1])
    assert (last.queued_requests.num_decode_requests, last.queued_requests.sum_decode_kv_tokens) == (5, kv)

    # KV arrives: the pass that runs them reports decodes; then they finish and heartbeats resume.
    step(sched, finished_recving=[r.request_id for r in reqs])
    step(sched)
    rec = sub.wait_for(lambda r: r.scheduled_requests.num_decode_requests == 5, timeout=2.0)
    assert rec is not None and rec.scheduled_requests.num_prefill_requests == 0
    assert rec.scheduled_requests.sum_decode_kv_tokens == kv


def test_no_heartbeat_inside_a_long_pass_and_idle_heartbeats_after(wired: Any, tmp_path: Path) -> None:
    make, sub = wired
    sched = make()
    sched.add_request(make_request(50, 2))
    out = sched.schedule()
    t_dispatch = time.monotonic()
    n_before = len(sub.snapshot())
    time.sleep(1.6)  # a forward pass longer than the heartbeat interval
    during = sub.snapshot()[n_before:]
    assert during == [], f"records published in the middle of a pass: {during}"
    sched.update_from_output(out, prefill_done_output(sched, out))
    rec = sub.wait_for(lambda r: r.scheduled_requests.num_prefill_requests == 1, timeout=2.0)
    assert rec is not None and rec.wall_time >= 1.6 and rec.wall_time <= time.monotonic() - t_dispatch
    assert rec.scheduled_requests.sum_prefill_tokens == 50
    while sched.has_requests():
        out = sched.schedule()
        sched.update_from_output(out, model_output(out))
    time.sleep(0.3)  # let the last pass's record arrive
    n_idle = len(sub.snapshot())
    time.sleep(1.3)
    beats = sub.snapshot()[n_idle:]
    assert beats, "no idle heartbeat"
    assert all(b.wall_time == 0.0 and b.queued_requests.num_prefill_requests == 0 for b in beats)
    # The publisher's counters are exported through DYN_FPM_STATS_FILE ({dp_rank} filled in).
    stats_file = tmp_path / "fpm-0.json"
    deadline = time.monotonic() + 3
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if stats_file.exists():
            stats = json.loads(stats_file.read_text())
            if stats.get("published", 0) >= 2:
                break
        time.sleep(0.1)
    assert stats.get("published", 0) >= 2 and stats["worker_id"] == "decode-1"


def test_preempted_requests_report_nonzero_queued_decode_kv_on_the_wire(wired: Any) -> None:
    make, sub = wired
    sched = make(num_blocks=10, max_num_batched_tokens=512)
    for _ in range(3):
        sched.add_request(make_request(40, 60))
    for _ in range(120):
        step(sched)
        preempted = [r for r in sched.requests.values() if r.status.name == "PREEMPTED"]
        if preempted:
            break
    assert preempted, "no preemption"
    kv = sum(r.num_tokens for r in preempted)
    rec = sub.wait_for(lambda r: r.queued_requests.num_decode_requests == len(preempted), timeout=2.0)
    assert rec is not None and rec.queued_requests.sum_decode_kv_tokens == kv > 0
