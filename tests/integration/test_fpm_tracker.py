"""FpmTracker: the pure message handling (gaps, restarts, staleness, garbage) and the NATS path."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, encode
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_subjects import FPM_TOPIC, EventEnvelope, encode_envelope, fpm_subject
from dynamo.common.fpm_tracker import FpmTracker, TrackedWorker, WorkerKey, record_to_dict
from dynamo_fpm_testing.fpm_support import full_record, wait_until
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NS = "trk"
SUBJ = fpm_subject(NS, "backend")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def msg(record: ForwardPassMetrics, *, counter: int, pid: int = 7, seq: int = 0, at: int = 1_000) -> bytes:
    rec = msgspec.structs.replace(record, counter_id=counter)
    return encode_envelope(EventEnvelope(pid, seq, at, FPM_TOPIC, encode(rec)))


def test_latest_record_per_key_and_timing_record() -> None:
    clock = FakeClock()
    t = FpmTracker(NS, clock=clock)
    a = full_record("a", 0)
    t.handle_message(SUBJ, msg(a, counter=0))
    clock.now += 1
    hb = ForwardPassMetrics(worker_id="a", dp_rank=0)
    t.handle_message(SUBJ, msg(hb, counter=1, at=2_000))
    t.handle_message(fpm_subject(NS, "prefill"), msg(full_record("a", 0, seed=2), counter=0, pid=8))
    t.handle_message(SUBJ, msg(full_record("a", 1), counter=0, pid=9))
    ws = t.workers()
    assert [w.key for w in ws] == [
        WorkerKey("backend", "generate", "a", 0),
        WorkerKey("backend", "generate", "a", 1),
        WorkerKey("prefill", "generate", "a", 0),
    ]
    w = ws[0]
    assert w.record == msgspec.structs.replace(hb, counter_id=1)
    assert w.last_timing_record == a  # the heartbeat is not a timing sample
    assert (w.records, w.gaps, w.restarts, w.received_at, w.published_at_ms) == (2, 0, 0, 101.0, 2_000)
    assert t.stats().accepted == 4 and t.stats().rejected() == 0


def test_gaps_restarts_duplicates() -> None:
    t = FpmTracker(NS, clock=FakeClock())
    r = full_record("w")
    for c in (0, 1, 5, 6):  # 2, 3, 4 missing
        t.handle_message(SUBJ, msg(r, counter=c))
    t.handle_message(SUBJ, msg(r, counter=6))  # duplicate: ignored
    t.handle_message(SUBJ, msg(r, counter=0, pid=99))  # a new publisher starts over
    t.handle_message(SUBJ, msg(r, counter=1, pid=99))
    t.handle_message(SUBJ, msg(r, counter=0, pid=99))  # the same publisher went backwards
    (w,) = t.workers()
    assert (w.gaps, w.restarts, w.duplicates, w.records) == (3, 2, 1, 7)
    st = t.stats()
    assert (st.gaps, st.restarts, st.duplicates) == (3, 2, 1)


def test_stale_after_and_forget() -> None:
    clock = FakeClock()
    t = FpmTracker(NS, stale_after=5.0, clock=clock)
    t.handle_message(SUBJ, msg(full_record("old"), counter=0))
    clock.now += 4
    t.handle_message(SUBJ, msg(full_record("new"), counter=0, pid=8))
    clock.now += 2  # "old" is now 6 s old, "new" 2 s
    assert [w.key.worker_id for w in t.workers()] == ["new"]
    every = t.workers(include_stale=True)
    assert [(w.key.worker_id, w.stale) for w in every] == [("new", False), ("old", True)]
    t.handle_message(SUBJ, msg(full_record("old"), counter=1))  # fresh again
    assert [w.key.worker_id for w in t.workers()] == ["new", "old"]
    t.forget(WorkerKey("backend", "generate", "old", 0))
    assert [w.key.worker_id for w in t.workers(include_stale=True)] == ["new"]


def test_rejections_are_counted_by_reason() -> None:
    t = FpmTracker(NS, component="backend", clock=FakeClock())
    good = msg(full_record("w"), counter=0)
    t.handle_message("namespace.other.component.backend.endpoint.generate.forward-pass-metrics", good)
    t.handle_message(fpm_subject(NS, "prefill"), good)  # filtered component
    t.handle_message("not.an.fpm.subject", good)
    t.handle_message(SUBJ, b"\xc1garbage")
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, "kv-events", encode(full_record()))))
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, b"\x93\x01\x02")))
    v2 = msgspec.msgpack.encode({"version": 2, "worker_id": "w", "new_layout": [1, 2]})
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, v2)))
    v3 = encode(msgspec.structs.replace(full_record("w"), version=3))
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, v3)))
    t.handle_message(SUBJ, msg(ForwardPassMetrics(worker_id=""), counter=0))
    st = t.stats()
    assert (st.wrong_subject, st.malformed_envelope, st.wrong_topic) == (3, 1, 1)
    assert (st.malformed_record, st.wrong_version, st.missing_worker_id) == (1, 2, 1)
    assert st.received == 9 and st.accepted == 0 and t.workers(include_stale=True) == []
    t.handle_message(SUBJ, good)
    assert t.stats().accepted == 1


def test_upstream_record_without_extension_fields() -> None:
    """An upstream producer's record (no extension keys) is accepted; extensions read as None."""
    plain = msgspec.msgpack.encode(
        {"version": 1, "worker_id": "up", "dp_rank": 0, "counter_id": 3, "wall_time": 0.5, "unknown_key": 1}
    )
    t = FpmTracker(NS, clock=FakeClock())
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, plain)))
    (w,) = t.workers()
    assert w.record.counter_id == 3 and w.record.queued_requests.num_decode_kv_ready_requests is None


def test_listener_errors_never_escape() -> None:
    t = FpmTracker(NS, clock=FakeClock())
    seen: list[tuple[str, str]] = []

    def bad(w: TrackedWorker, s: str) -> None:
        raise RuntimeError("listener bug")

    t.add_listener(bad)
    t.add_listener(lambda w, s: seen.append((w.key.worker_id, s)))
    t.handle_message(SUBJ, msg(full_record("w"), counter=0))
    assert seen == [("w", SUBJ)] and t.stats().listener_errors == 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300), cut=st.integers(min_value=0, max_value=400))
def test_garbage_and_truncation_never_raise(data: bytes, cut: int) -> None:
    t = FpmTracker(NS, clock=FakeClock())
    t.handle_message(SUBJ, data)
    good = msg(full_record("w"), counter=0)
    t.handle_message(SUBJ, good[: cut % (len(good) + 1)])
    inner = encode(full_record("w"))
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, inner[: cut % len(inner)])))
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, data)))
    st = t.stats()
    assert st.received == 4 and st.accepted + st.rejected() + st.duplicates == 4


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_anything = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)
# The record's real keys (the schema itself; its literal order is pinned in test_forward_pass_metrics.py).
_FIELDS = list(ForwardPassMetrics.__struct_fields__)
# Record-shaped maps: the real keys with values of any type, so the decoder's type checks are exercised.
_record_like = st.dictionaries(st.sampled_from(_FIELDS), _anything, max_size=7)


@given(obj=_anything, rec=_record_like)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_msgpack_never_raises(obj: object, rec: dict) -> None:
    t = FpmTracker(NS, clock=FakeClock())
    packed = msgspec.msgpack.encode(obj)
    t.handle_message(SUBJ, packed)
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, packed)))
    t.handle_message(SUBJ, encode_envelope(EventEnvelope(1, 0, 0, FPM_TOPIC, msgspec.msgpack.encode(rec))))
    st_ = t.stats()
    assert st_.accepted + st_.rejected() + st_.duplicates == 3
    for w in t.workers(include_stale=True):  # whatever was accepted is a valid, typed record
        # The point of the check: forged input still decodes to a str, whatever the annotation promises.
        assert isinstance(w.record.worker_id, str) and w.record.worker_id  # type: ignore[redundant-expr]


def test_record_to_dict_nests_every_field() -> None:
    d = record_to_dict(full_record("w"))
    assert list(d) == [
        "version",
        "worker_id",
        "dp_rank",
        "counter_id",
        "wall_time",
        "scheduled_requests",
        "queued_requests",
        "num_held_kv_requests",
        "sum_held_kv_tokens",
        "max_held_kv_age",
    ]
    assert d["scheduled_requests"]["sum_prefill_kv_tokens"] == 64
    assert d["queued_requests"]["sum_decode_kv_ready_tokens"] == 145


def test_invalid_namespace() -> None:
    with pytest.raises(ValueError):
        FpmTracker("bad.ns")


# ----------------------------------------------------------------------------- over NATS


async def test_tracker_over_nats_with_publishers_and_garbage(nats_server: EmbeddedNatsServer) -> None:
    tracker = FpmTracker(NS, nats_url=nats_server.url)
    await tracker.start()
    seen: list[str] = []
    tracker.add_listener(lambda w, s: seen.append(s))
    pubs = [
        FpmDirectPublisher(namespace=NS, component=c, worker_id=f"w-{c}", dp_rank=r, nats_url=nats_server.url)
        for c in ("prefill", "backend")
        for r in (0, 1)
    ]
    try:
        for p in pubs:
            for i in range(10):
                p.publish(full_record(p.worker_id, p.dp_rank, seed=i + 1))
        # garbage on the same subjects: counted, the tracker keeps going
        await tracker._nc.publish(SUBJ, b"garbage")
        await tracker._nc.publish(
            fpm_subject(NS, "prefill"), encode_envelope(EventEnvelope(1, 0, 0, "x", b""))
        )
        assert await wait_until(
            lambda: tracker.stats().accepted >= 40 and tracker.stats().rejected() >= 2, timeout=10
        )
        ws = tracker.workers()
        assert len(ws) == 4
        for w in ws:
            assert w.records >= 10 and w.gaps == 0 and w.restarts == 0
            assert w.last_timing_record is not None
            assert w.last_timing_record == msgspec.structs.replace(
                full_record(w.key.worker_id, w.key.dp_rank, seed=10),
                counter_id=w.last_timing_record.counter_id,
            )
        assert set(seen) == {fpm_subject(NS, "prefill"), SUBJ}
        st = tracker.stats()
        assert (st.malformed_envelope, st.wrong_topic) == (1, 1)
    finally:
        for p in pubs:
            p.close()
        await tracker.stop()


async def test_tracker_component_filter(nats_server: EmbeddedNatsServer) -> None:
    tracker = FpmTracker(NS, component="prefill", nats_url=nats_server.url)
    await tracker.start()
    pubs = [
        FpmDirectPublisher(namespace=NS, component=c, worker_id=f"f-{c}", nats_url=nats_server.url)
        for c in ("prefill", "backend")
    ]
    try:
        for p in pubs:
            p.publish(full_record(p.worker_id))
        assert await wait_until(lambda: tracker.stats().accepted >= 1)
        await asyncio.sleep(0.2)
        assert [w.key.worker_id for w in tracker.workers()] == ["f-prefill"]
        assert tracker.stats().wrong_subject == 0  # the filter is on the subscription itself
    finally:
        for p in pubs:
            p.close()
        await tracker.stop()


async def test_tracker_survives_nats_restart(fresh_nats_server: EmbeddedNatsServer) -> None:
    url = fresh_nats_server.url
    tracker = FpmTracker(NS, nats_url=url)
    await tracker.start()
    pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id="rs", nats_url=url)
    try:
        pub.publish(full_record("rs"))
        assert await wait_until(lambda: tracker.stats().accepted >= 1)
        fresh_nats_server.stop()
        await asyncio.sleep(0.5)
        fresh_nats_server.start()
        assert await wait_until(lambda: tracker.connected and pub.stats().connected, timeout=8)
        await asyncio.sleep(0.2)
        n = tracker.stats().accepted
        pub.publish(full_record("rs", seed=3))
        assert await wait_until(lambda: tracker.stats().accepted > n, timeout=5)
        assert tracker.stats().reconnects >= 1
    finally:
        pub.close()
        await tracker.stop()


async def test_start_fails_fast_when_nats_unreachable() -> None:
    from dynamo.common.ports import free_port

    tracker = FpmTracker(NS, nats_url=f"nats://127.0.0.1:{free_port()}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await tracker.start(timeout=1.5)
    assert loop.time() - t0 < 6
