"""FpmDirectPublisher against a real nats-server: round trip, heartbeats, overflow, outages, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from dynamo.common import nats_fast_path
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, is_heartbeat
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_subjects import FPM_TOPIC, fpm_subject
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.common.nats_options import (
    nats_connect_options_from_env,
    nats_servers,
    nats_url_from_env,
    redact_url,
)
from dynamo.common.ports import free_port
from dynamo_fpm_testing.fpm_support import (
    Collector,
    CustomNatsServer,
    full_record,
    self_signed_cert,
    wait_until,
)
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

NS = "pubtest"


def make_pub(url: str, **kw: Any) -> FpmDirectPublisher:
    kw.setdefault("worker_id", "worker-1")
    return FpmDirectPublisher(namespace=NS, component="backend", nats_url=url, **kw)


@pytest.fixture(params=["fast", "plain"])
def write_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways to NATS: the private-internals fast path and the public-API fallback (nats_fast_path)."""
    if request.param == "plain":
        monkeypatch.setattr(nats_fast_path, "PLAIN_ONLY", True)
    return str(request.param)


async def test_round_trip_every_field_and_envelope(nats_server: EmbeddedNatsServer, write_path: str) -> None:
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, dp_rank=2, heartbeat_interval=60)
    try:
        sent = [full_record("worker-1", 2, seed=i + 1) for i in range(5)]
        for rec in sent:
            pub.publish(rec)
        assert await wait_until(lambda: len(col.items) >= 5)
        assert pub._writer is not None and pub._writer.mode == ("direct" if write_path == "fast" else "plain")
    finally:
        pub.close()
        await col.stop()
    got = col.items[:5]
    for i, (item, rec) in enumerate(zip(got, sent, strict=True)):
        assert item.subject == fpm_subject(NS, "backend", "generate")
        assert item.envelope.topic == FPM_TOPIC
        assert item.envelope.sequence == i
        assert item.envelope.publisher_id == pub.publisher_id
        assert 0 <= pub.publisher_id < 2**63
        assert abs(item.envelope.published_at - time.time() * 1000) < 60_000
        # counter_id is stamped by the publisher; every other field is the caller's, bit for bit.
        assert item.record == msgspec.structs.replace(rec, counter_id=i)
    st = pub.stats()
    assert (st.published, st.dropped, st.queued) == (5, 0, 0)


async def test_many_publishers_counters_per_publisher(nats_server: EmbeddedNatsServer) -> None:
    col = await Collector(
        nats_server.url, f"namespace.{NS}.component.*.endpoint.*.forward-pass-metrics"
    ).start()
    pubs = [
        FpmDirectPublisher(
            namespace=NS,
            component="prefill" if i % 2 else "backend",
            worker_id=f"w{i}",
            dp_rank=i % 3,
            nats_url=nats_server.url,
            heartbeat_interval=60,
        )
        for i in range(8)
    ]
    try:
        for n in range(50):
            for i, p in enumerate(pubs):
                p.publish(ForwardPassMetrics(worker_id=f"w{i}", dp_rank=i % 3, wall_time=0.001 * (n + 1)))
        assert await wait_until(lambda: len(col.items) >= 400, timeout=10)
    finally:
        for p in pubs:
            p.close()
        await col.stop()
    by_worker: dict[str, list[int]] = {}
    for item in col.items:
        assert item.record is not None
        by_worker.setdefault(item.record.worker_id, []).append(item.record.counter_id)
        comp = "prefill" if int(item.record.worker_id[1:]) % 2 else "backend"
        assert item.subject == fpm_subject(NS, comp)
    assert sorted(by_worker) == sorted(f"w{i}" for i in range(8))
    for counters in by_worker.values():
        assert counters == list(range(50))
    assert len({p.publisher_id for p in pubs}) == 8


async def test_idle_heartbeat_and_idle_record_and_suspension(nats_server: EmbeddedNatsServer) -> None:
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, worker_id="hb", dp_rank=1, heartbeat_interval=0.2)
    try:
        assert await wait_until(lambda: len(col.items) >= 2, timeout=3)
        first = col.records()[0]
        assert is_heartbeat(first) and first.worker_id == "hb" and first.dp_rank == 1
        # A snapshot handed over is repeated instead of zeros.
        snapshot = msgspec.structs.replace(full_record("hb", 1), wall_time=0.0)
        pub.set_idle_record(snapshot)
        n = len(col.items)
        assert await wait_until(lambda: len(col.items) >= n + 2, timeout=3)
        assert col.records()[-1] == msgspec.structs.replace(snapshot, counter_id=col.records()[-1].counter_id)
        # Suspended: nothing at all for several intervals.
        pub.set_idle_record(None)
        await asyncio.sleep(0.3)
        n = len(col.items)
        await asyncio.sleep(0.8)
        assert len(col.items) == n
        # A real record still goes out immediately; heartbeats never interleave with counters out of order.
        pub.publish(full_record("hb", 1))
        assert await wait_until(lambda: len(col.items) == n + 1, timeout=2)
    finally:
        pub.close()
        await col.stop()
    counters = [r.counter_id for r in col.records()]
    assert counters == list(range(len(counters)))
    st = pub.stats()
    assert st.heartbeats == len(counters) - 1 and st.published == 1


async def test_heartbeats_wait_for_the_gate_file(nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    """A standby worker's engine: no heartbeat until the worker registered and created the gate file."""
    gate = tmp_path / "registered"
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, worker_id="standby", heartbeat_interval=0.1, gate_file=str(gate))
    try:
        await asyncio.sleep(0.8)
        assert col.items == [] and pub.stats().heartbeats == 0
        gate.touch()
        assert await wait_until(lambda: len(col.items) >= 2, timeout=3)
        gate.unlink()  # parked again
        await asyncio.sleep(0.3)
        n = len(col.items)
        await asyncio.sleep(0.6)
        assert len(col.items) == n
    finally:
        pub.close()
        await col.stop()


async def test_heartbeat_only_when_nothing_was_sent(nats_server: EmbeddedNatsServer) -> None:
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, worker_id="busy", heartbeat_interval=1.0)
    try:
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:  # a record every 50 ms: never idle for 1 s
            pub.publish(full_record("busy"))
            await asyncio.sleep(0.05)
        assert await wait_until(lambda: pub.stats().queued == 0)
    finally:
        pub.close()
        await col.stop()
    assert pub.stats().heartbeats <= 1  # at most the one before the first record
    assert sum(is_heartbeat(r) for r in col.records()[1:]) == 0


def test_fast_path_only_on_tested_nats_py_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The private internals are used only by the nats-py versions they were checked against."""

    class TcpTransport:  # the class name nats-py's plain TCP transport has
        pass

    class Client:
        _transport = TcpTransport()
        is_connected = True

    assert nats_fast_path.nats_py_version() is not None  # the installed one is known
    for version, mode in (((2, 16), "direct"), ((2, 9), "direct"), ((2, 17), "plain"), ((2, 8), "plain")):
        monkeypatch.setattr(nats_fast_path, "nats_py_version", lambda v=version: v)
        assert nats_fast_path.FrameWriter(Client(), "s").mode == mode, version
    monkeypatch.setattr(nats_fast_path, "nats_py_version", lambda: None)
    assert nats_fast_path.FrameWriter(Client(), "s").mode == "plain"


async def test_overflow_drops_oldest_and_counts_exactly(
    fresh_nats_server: EmbeddedNatsServer, write_path: str
) -> None:
    url = fresh_nats_server.url
    fresh_nats_server.stop()  # nothing can leave: the queue must overflow
    pub = make_pub(url, max_queue=100, heartbeat_interval=60)
    try:
        for i in range(1000):
            pub.publish(full_record(seed=i + 1))
        st = pub.stats()
        assert (st.queued, st.dropped, st.published, st.connected) == (100, 900, 0, False)
        fresh_nats_server.start()
        col = await Collector(url, fpm_subject(NS, "backend")).start()
        assert await wait_until(lambda: len(col.items) >= 100, timeout=8)
        await asyncio.sleep(0.2)
    finally:
        pub.close()
    await col.stop()
    recs = col.records()
    # The newest 100 survive, in order, and counter_id keeps the gap of the 900 dropped ones.
    assert [r.counter_id for r in recs] == list(range(900, 1000))
    assert recs[0].scheduled_requests == full_record(seed=901).scheduled_requests
    st = pub.stats()
    assert (st.published, st.dropped, st.queued) == (100, 900, 0)


async def test_nats_down_acceptance_100k_calls_fast_bounded_counted_then_resumes(
    fresh_nats_server: EmbeddedNatsServer,
) -> None:
    url = fresh_nats_server.url
    pub = make_pub(url, heartbeat_interval=60)
    col = await Collector(url, fpm_subject(NS, "backend")).start()
    try:
        pub.publish(full_record())
        assert await wait_until(lambda: len(col.items) == 1)
        await col.stop()
        fresh_nats_server.stop()
        assert await wait_until(lambda: not pub.stats().connected, timeout=5)
        rec = full_record()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0, cpu0 = time.perf_counter(), time.thread_time()
        for _ in range(100_000):
            pub.publish(rec)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        assert cpu < 0.2, f"100k publish() calls took {cpu:.3f} s of CPU with NATS down"
        # Wall time is the acceptance figure; a machine running several times more threads than it has
        # cores stretches it (our thread waits for a CPU), so only then is the bound relaxed.
        overloaded = os.getloadavg()[0] > 2 * (os.cpu_count() or 1)
        assert elapsed < (2.0 if overloaded else 0.2), f"100k publish() calls took {elapsed:.3f} s"
        st = pub.stats()
        assert st.queued == pub.max_queue
        assert st.dropped == 100_000 - pub.max_queue
        # bounded: a queue of 8192 references to one record, far below 50 MiB of growth
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024
        fresh_nats_server.start()
        t_back = time.monotonic()
        col = await Collector(url, fpm_subject(NS, "backend")).start()
        n0 = len(col.items)
        pub.publish(full_record(seed=7))
        assert await wait_until(lambda: any(r.counter_id == 100_001 for r in col.records()), timeout=5)
        assert time.monotonic() - t_back < 5
        assert len(col.items) > n0
        assert pub.stats().reconnects >= 1
    finally:
        pub.close()
        await col.stop()
    st = pub.stats()
    assert st.published + st.dropped == 100_002


@pytest.mark.parametrize("kind", ["refused", "silent"])
async def test_nats_down_at_start_constructor_returns_at_once(kind: str) -> None:
    """Nothing listening (refused at once), or a server that accepts TCP but never speaks (a connect
    attempt hangs until its timeout): neither the constructor nor publish() nor close() waits for it."""
    silent = None
    if kind == "silent":
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
    else:
        url = f"nats://127.0.0.1:{free_port()}"
    try:
        t0 = time.perf_counter()
        pub = make_pub(url, heartbeat_interval=60)
        assert time.perf_counter() - t0 < 1.0  # a thread start; a blocking connect would take 2 s
        try:
            t0 = time.perf_counter()
            for _ in range(10):
                pub.publish(full_record())
            assert time.perf_counter() - t0 < 0.05
            await asyncio.sleep(0.5)
            st = pub.stats()
            assert not st.connected and st.queued == 10
            if kind == "refused":
                assert "Connect call failed" in (st.last_error or "")
        finally:
            t0 = time.perf_counter()
            pub.close(timeout=0.5)
            assert time.perf_counter() - t0 < 2.5
        st = pub.stats()
        assert (st.published, st.dropped, st.queued) == (0, 10, 0)
    finally:
        if silent is not None:
            silent.close()


async def test_restart_mid_stream_caller_never_blocked(fresh_nats_server: EmbeddedNatsServer) -> None:
    """A steady producer thread keeps publishing across a NATS restart; nothing raises or stalls."""
    url = fresh_nats_server.url
    pub = make_pub(url, heartbeat_interval=60)
    col = await Collector(url, fpm_subject(NS, "backend")).start()
    calls: list[tuple[float, float]] = []  # (start, duration) of every publish()
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                pub.publish(full_record())
                calls.append((t0, time.perf_counter() - t0))
                time.sleep(0.002)
        except BaseException as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    th = threading.Thread(target=producer)
    th.start()
    try:
        assert await wait_until(lambda: len(col.items) > 20)
        await col.stop()
        fresh_nats_server.stop()
        down_from = time.perf_counter()
        await asyncio.sleep(1.0)
        down_to = time.perf_counter()
        fresh_nats_server.start()
        col = await Collector(url, fpm_subject(NS, "backend")).start()
        assert await wait_until(lambda: len(col.items) > 20, timeout=5)
    finally:
        stop.set()
        th.join()
        pub.close()
        await col.stop()
    assert not errors
    # Never waited on the network: a hand-off that blocks while NATS is down would make (almost) no
    # calls during the 1 s outage; this one keeps its pace (~500 calls; fewer on a loaded machine).
    during_outage = [d for t, d in calls if down_from <= t < down_to]
    assert len(during_outage) >= 50, len(during_outage)
    assert max(d for _, d in calls) < 0.5  # a preempted call, at worst; never a connect timeout
    # Every record is accounted for (the outage is shorter than the queue: normally nothing is dropped).
    st = pub.stats()
    assert st.published + st.dropped == len(calls) and st.queued == 0
    assert st.reconnects >= 1 and st.connected is False
    counters = [r.counter_id for r in col.records()]
    assert counters == sorted(counters)


async def test_close_flushes_queue_and_is_idempotent(nats_server: EmbeddedNatsServer) -> None:
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, heartbeat_interval=60)
    await wait_until(lambda: pub.stats().connected)
    for i in range(3000):
        pub.publish(full_record(seed=i + 1))
    pub.close()
    pub.close()
    try:
        assert await wait_until(lambda: len(col.items) >= 3000)
    finally:
        await col.stop()
    st = pub.stats()
    assert (st.published, st.dropped) == (3000, 0)
    pub.publish(full_record())  # after close: still never raises


async def test_bad_record_counted_not_raised(nats_server: EmbeddedNatsServer) -> None:
    col = await Collector(nats_server.url, fpm_subject(NS, "backend")).start()
    pub = make_pub(nats_server.url, heartbeat_interval=60)
    try:
        pub.publish("not a record")  # type: ignore[arg-type]  # the point: a wrong type at run time
        pub.publish(full_record())
        assert await wait_until(lambda: len(col.items) >= 1)
    finally:
        pub.close()
        await col.stop()
    st = pub.stats()
    assert (st.published, st.dropped) == (1, 1)
    assert "unencodable" in (st.last_error or "")
    assert col.records()[0].counter_id == 1  # the bad one left its gap


async def test_stats_file_written_atomically(nats_server: EmbeddedNatsServer, tmp_path) -> None:
    path = tmp_path / "fpm-stats.json"
    pub = make_pub(nats_server.url, heartbeat_interval=60, stats_file=str(path))
    try:
        pub.publish(full_record())
        assert await wait_until(lambda: path.exists())
        assert await wait_until(lambda: json.loads(path.read_text())["published"] == 1, timeout=3)
    finally:
        pub.close()
    data = json.loads(path.read_text())
    assert data["worker_id"] == "worker-1" and data["dropped"] == 0 and data["connected"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fpm-stats.json"]


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        FpmDirectPublisher(namespace="a.b", component="backend", worker_id="w", start=False)
    with pytest.raises(ValueError):
        FpmDirectPublisher(namespace="ns", component="backend", worker_id="w", max_queue=0, start=False)


def test_publish_cost_is_a_deque_append() -> None:
    """No network, no wake-up: far below the 0.5 µs median target even in a slow CI (loose bound)."""
    pub = FpmDirectPublisher(namespace="ns", component="backend", worker_id="w", start=False)
    rec = full_record()
    samples = []
    for _ in range(20):
        t0 = time.perf_counter_ns()
        for _ in range(1000):
            pub.publish(rec)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    assert samples[len(samples) // 2] < 2000  # ns per call; the benchmark measures the real figure


def test_flood_does_not_starve_the_sender(nats_server: EmbeddedNatsServer, write_path: str) -> None:
    """A caller that never releases the GIL: the sender still gets turns, and every record is accounted."""
    pub = make_pub(nats_server.url, heartbeat_interval=60)
    deadline = time.monotonic() + 10
    while not pub.stats().connected and time.monotonic() < deadline:
        time.sleep(0.01)
    rec = full_record()
    offered = 0
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        for _ in range(1000):
            pub.publish(rec)
        offered += 1000
    during = pub.stats().published
    pub.close()
    st = pub.stats()
    # A sender starved by the flood would have sent (almost) nothing during it (measured: ~100k/s).
    assert during >= 2_000, st
    assert st.published + st.dropped == offered and st.queued == 0
    assert st.dropped > 0  # the flood outran the sender: drops happened and were counted


# A publishing process whose main thread holds the GIL after each record (a 0.5 s switch interval and a
# pure-Python spin), as an engine loop stepping only parked requests did (docs/fpm-core.md). Each
# record carries its publish time (monotonic, the same clock in every process on Linux) in wall_time.
_SPINNING_CALLER = """
import sys, time
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.fpm_publisher import FpmDirectPublisher
url, hand_over = sys.argv[1], sys.argv[2] == "hand-over"
pub = FpmDirectPublisher(
    namespace="pubtest", component="spin", worker_id="w", nats_url=url, heartbeat_interval=60
)
deadline = time.monotonic() + 10
while not pub.stats().connected and time.monotonic() < deadline:
    time.sleep(0.01)
sys.setswitchinterval(0.5)
for i in range(5):
    pub.publish(ForwardPassMetrics(worker_id="w", wall_time=time.monotonic()))
    if hand_over:
        assert pub.wait_sent(0.2)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
sys.setswitchinterval(0.005)
pub.close()
"""


@pytest.mark.parametrize("hand_over", [True, False], ids=["hand-over", "control"])
async def test_wait_sent_gets_a_record_out_past_a_caller_that_keeps_the_gil(
    nats_server: EmbeddedNatsServer, hand_over: bool
) -> None:
    """With ``wait_sent`` each record is on the wire within milliseconds; without, it waits for the spin."""
    col = await Collector(nats_server.url, fpm_subject(NS, "spin")).start()
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SPINNING_CALLER, nats_server.url, "hand-over" if hand_over else "control"
        )
        assert await asyncio.wait_for(child.wait(), 30) == 0
        assert await wait_until(lambda: len(col.records(heartbeats=False)) >= 5)
    finally:
        await col.stop()
    lags = sorted(item.at - item.record.wall_time for item in col.items if item.record is not None)
    if hand_over:
        assert lags[-1] < 0.1, lags  # measured: about 1 ms
    else:
        assert lags[len(lags) // 2] > 0.15, lags  # the control: this caller does starve the sender (0.3 s)


async def test_wait_sent_without_records_or_connection_returns_at_once(
    nats_server: EmbeddedNatsServer,
) -> None:
    """Nothing handed over: True at once. NATS unreachable: False at once, the record kept queued."""
    pub = make_pub(nats_server.url, heartbeat_interval=60)
    try:
        t0 = time.perf_counter()
        assert pub.wait_sent(5.0)
        assert time.perf_counter() - t0 < 0.05
        assert await wait_until(lambda: pub.stats().connected)
        pub.publish(full_record())
        assert pub.wait_sent(5.0) and pub.stats().published == 1
    finally:
        pub.close()
    down = make_pub(f"nats://127.0.0.1:{free_port()}", heartbeat_interval=60)
    try:
        down.publish(full_record())
        t0 = time.perf_counter()
        assert not down.wait_sent(5.0)
        assert time.perf_counter() - t0 < 0.05
        assert down.stats().queued == 1
    finally:
        down.close(timeout=0.1)


# ----------------------------------------------------------------------------- NATS options (auth, TLS)


def test_nats_options_from_env(tmp_path: Path) -> None:
    assert nats_url_from_env({}) == "nats://localhost:4222"
    assert nats_url_from_env({"NATS_SERVER": " nats://a:1 "}) == "nats://a:1"
    assert nats_servers("nats://a:1, nats://b:2") == ["nats://a:1", "nats://b:2"]
    assert nats_connect_options_from_env({}) == {}
    # One method, in the runtime's order (user/password before token; tests/compat/test_nats_names.py).
    opts = nats_connect_options_from_env({"NATS_USER": "u", "NATS_PASSWORD": "p", "NATS_TOKEN": "t"})
    assert opts == {"user": "u", "password": "p"}
    creds = tmp_path / "x.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert nats_connect_options_from_env({"NATS_CREDS": str(creds)}) == {"user_credentials": str(creds)}
    with pytest.raises(ValueError, match="NATS_CREDS"):
        nats_connect_options_from_env({"NATS_CREDS": str(tmp_path / "missing.creds")})
    with pytest.raises(ValueError, match="NATS_PASSWORD is set without"):
        nats_connect_options_from_env({"NATS_PASSWORD": "p"})
    with pytest.raises(ValueError, match="together"):
        nats_connect_options_from_env({"NATS_TLS_CERT": "c.pem"})
    cert, key = self_signed_cert(tmp_path)
    ctx = nats_connect_options_from_env(
        {"NATS_TLS_CA": str(cert), "NATS_TLS_CERT": str(cert), "NATS_TLS_KEY": str(key)}
    )["tls"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert redact_url("nats://user:secret@h:1,tls://h2:2") == "nats://***@h:1,tls://h2:2"


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (("--user", "fpm", "--pass", "s3cret"), {"NATS_USER": "fpm", "NATS_PASSWORD": "s3cret"}),
        (("--auth", "tok3n"), {"NATS_TOKEN": "tok3n"}),
    ],
    ids=["user-password", "token"],
)
async def test_auth_from_env(
    flags: tuple[str, ...], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with CustomNatsServer(*flags) as server:
        url = f"nats://127.0.0.1:{server.port}"
        # Without credentials the server refuses: the publisher keeps trying, counts, never raises.
        for var in ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        refused = make_pub(url, heartbeat_interval=60)
        refused.publish(full_record())
        await asyncio.sleep(0.5)
        st = refused.stats()
        refused.close(timeout=0.2)
        assert not st.connected and "uthorization" in (st.last_error or "")
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        auth_url = (
            f"nats://{env['NATS_USER']}:{env['NATS_PASSWORD']}@127.0.0.1:{server.port}"
            if "NATS_USER" in env
            else f"nats://{env['NATS_TOKEN']}@127.0.0.1:{server.port}"
        )
        col = await Collector(auth_url, fpm_subject(NS, "backend")).start()
        pub = make_pub(url, heartbeat_interval=60)
        try:
            pub.publish(full_record())
            assert await wait_until(lambda: len(col.items) >= 1, timeout=5)
        finally:
            pub.close()
            await col.stop()


async def test_tls_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed_cert(tmp_path)
    with CustomNatsServer("--tls", "--tlscert", str(cert), "--tlskey", str(key)) as server:
        url = f"tls://127.0.0.1:{server.port}"
        monkeypatch.setenv("NATS_TLS_CA", str(cert))
        tracker = FpmTracker(NS, nats_url=url)
        await tracker.start()
        pub = make_pub(url, heartbeat_interval=60)
        try:
            pub.publish(full_record("tls-w"))
            assert await wait_until(lambda: tracker.stats().accepted >= 1, timeout=5)
            assert tracker.workers()[0].key.worker_id == "tls-w"
        finally:
            pub.close()
            await tracker.stop()
