"""The FPM schema: round trips, field order, never-raising decode, upstream compatibility."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from dynamo.common import forward_pass_metrics as fpm
from hypothesis import given
from hypothesis import strategies as st

UPSTREAM_FIELD_ORDER = [
    "version",
    "worker_id",
    "dp_rank",
    "counter_id",
    "wall_time",
    "scheduled_requests",
    "queued_requests",
]
# Ours, appended after upstream's fields (optional, None when not reported).
HELD_KV_FIELDS = ["num_held_kv_requests", "sum_held_kv_tokens", "max_held_kv_age"]


def load_upstream_schema(upstream_dir: Path) -> ModuleType:
    """Upstream's own schema module, loaded under a private name (it would shadow ours otherwise)."""
    path = upstream_dir / "dynamo" / "common" / "forward_pass_metrics.py"
    spec = importlib.util.spec_from_file_location("upstream_forward_pass_metrics", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sample_record(**extra: int) -> fpm.ForwardPassMetrics:
    return fpm.ForwardPassMetrics(
        worker_id="7587888437432164612",
        dp_rank=3,
        counter_id=42,
        wall_time=0.0125,
        scheduled_requests=fpm.ScheduledRequestMetrics(
            num_prefill_requests=2,
            sum_prefill_tokens=300,
            var_prefill_length=12.5,
            sum_prefill_kv_tokens=64,
            num_decode_requests=5,
            sum_decode_kv_tokens=900,
            var_decode_kv_tokens=33.0,
        ),
        queued_requests=fpm.QueuedRequestMetrics(
            num_prefill_requests=4,
            sum_prefill_tokens=400,
            var_prefill_length=1.5,
            num_decode_requests=6,
            sum_decode_kv_tokens=345,
            var_decode_kv_tokens=2.25,
            **extra,
        ),
    )


def test_round_trip_every_field() -> None:
    rec = sample_record(
        num_decode_kv_transfer_requests=4,
        sum_decode_kv_transfer_tokens=200,
        num_decode_kv_ready_requests=1,
        sum_decode_kv_ready_tokens=100,
    )
    rec = msgspec.structs.replace(rec, num_held_kv_requests=3, sum_held_kv_tokens=210, max_held_kv_age=12.5)
    assert fpm.decode(fpm.encode(rec)) == rec


def test_wire_is_a_map_in_upstream_field_order() -> None:
    raw = msgspec.msgpack.decode(fpm.encode(sample_record()))
    assert list(raw) == UPSTREAM_FIELD_ORDER + HELD_KV_FIELDS
    assert list(raw["scheduled_requests"]) == [
        "num_prefill_requests",
        "sum_prefill_tokens",
        "var_prefill_length",
        "sum_prefill_kv_tokens",
        "num_decode_requests",
        "sum_decode_kv_tokens",
        "var_decode_kv_tokens",
    ]
    assert list(raw["queued_requests"])[:6] == [
        "num_prefill_requests",
        "sum_prefill_tokens",
        "var_prefill_length",
        "num_decode_requests",
        "sum_decode_kv_tokens",
        "var_decode_kv_tokens",
    ]


def test_decode_rejects_and_counts() -> None:
    before = fpm.decode_failures()
    assert fpm.decode(b"\xc1garbage") is None
    assert fpm.decode(b"") is None
    wrong = msgspec.msgpack.encode({"version": 2, "worker_id": "w"})
    assert fpm.decode(wrong) is None
    after = fpm.decode_failures()
    assert after.undecodable == before.undecodable + 2
    assert after.wrong_version == before.wrong_version + 1


@given(st.binary(max_size=300))
def test_decode_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    result = fpm.decode(data)
    assert result is None or isinstance(result, fpm.ForwardPassMetrics)


def test_every_truncation_is_rejected_not_raised() -> None:
    full = fpm.encode(sample_record())
    for cut in range(len(full)):
        assert fpm.decode(full[:cut]) is None


@given(st.lists(st.integers(min_value=0, max_value=10**7), max_size=60))
def test_welford_and_intmoments_match_population_variance(values: list[int]) -> None:
    acc = fpm.WelfordAccumulator()
    mom = fpm.IntMoments()
    for v in values:
        acc.add(v)
        mom.add(v)
    expected = statistics.pvariance(values) if values else 0.0
    assert acc.n == mom.n == len(values)
    assert acc.s == mom.s == sum(values)
    assert acc.variance() == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert mom.variance() == pytest.approx(expected, rel=1e-12, abs=1e-9)


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=40), st.data())
def test_intmoments_removal_is_exact(values: list[int], data: st.DataObject) -> None:
    mom = fpm.IntMoments()
    for v in values:
        mom.add(v)
    keep = data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values)))
    for v, k in zip(values, keep, strict=True):
        if not k:
            mom.remove(v)
    fresh = fpm.IntMoments()
    for v, k in zip(values, keep, strict=True):
        if k:
            fresh.add(v)
    assert (mom.n, mom.s, mom.sq) == (fresh.n, fresh.s, fresh.sq)
    assert mom.variance() == fresh.variance()


def test_heartbeat_detection() -> None:
    assert fpm.is_heartbeat(fpm.ForwardPassMetrics(worker_id="w"))
    assert not fpm.is_heartbeat(sample_record())
    snapshot = fpm.ForwardPassMetrics(
        worker_id="w",
        queued_requests=fpm.QueuedRequestMetrics(num_decode_requests=3, sum_decode_kv_tokens=90),
    )
    assert not fpm.is_heartbeat(snapshot)
    # KV held for a peer is not idle: a prefill engine pinned by a dead decode worker must not look idle.
    held = fpm.ForwardPassMetrics(worker_id="w", num_held_kv_requests=2, sum_held_kv_tokens=64)
    assert not fpm.is_heartbeat(held)
    assert fpm.is_heartbeat(fpm.ForwardPassMetrics(worker_id="w", num_held_kv_requests=0))


def test_ours_decodes_with_upstream_schema(upstream_dir: Path) -> None:
    up = load_upstream_schema(upstream_dir)
    rec = sample_record(num_decode_kv_transfer_requests=5, sum_decode_kv_transfer_tokens=345)
    rec = msgspec.structs.replace(rec, num_held_kv_requests=2, sum_held_kv_tokens=70, max_held_kv_age=3.5)
    theirs = up.decode(fpm.encode(rec))
    assert theirs is not None
    assert msgspec.structs.asdict(theirs.scheduled_requests) == msgspec.structs.asdict(rec.scheduled_requests)
    for name in ("version", "worker_id", "dp_rank", "counter_id", "wall_time"):
        assert getattr(theirs, name) == getattr(rec, name)
    q_theirs = msgspec.structs.asdict(theirs.queued_requests)
    q_ours = msgspec.structs.asdict(rec.queued_requests)
    assert q_theirs == {k: q_ours[k] for k in q_theirs}


def test_upstream_decodes_with_ours(upstream_dir: Path) -> None:
    up = load_upstream_schema(upstream_dir)
    theirs = up.ForwardPassMetrics(
        worker_id="42",
        dp_rank=1,
        counter_id=9,
        wall_time=0.5,
        scheduled_requests=up.ScheduledRequestMetrics(num_decode_requests=3, sum_decode_kv_tokens=30),
        queued_requests=up.QueuedRequestMetrics(num_decode_requests=2, sum_decode_kv_tokens=20),
    )
    ours = fpm.decode(up.encode(theirs))
    assert ours is not None
    assert ours.worker_id == "42" and ours.dp_rank == 1 and ours.counter_id == 9
    assert ours.scheduled_requests.num_decode_requests == 3
    assert ours.queued_requests.sum_decode_kv_tokens == 20
    # Extension fields are absent from upstream records: None, not a misleading zero.
    assert ours.queued_requests.num_decode_kv_transfer_requests is None
    assert ours.num_held_kv_requests is None and ours.max_held_kv_age is None
