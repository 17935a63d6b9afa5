"""Saying when the transport is lost: a real nats-server stopped for a few seconds and restarted on the
same port. Publisher and tracker each log the loss and the recovery once; the state shows in the
publisher's stats, the worker's ``/health`` and metrics, and the planner's metrics; per-message warnings
are rate-limited."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats
import pytest
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_subjects import fpm_subject
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.common.rate_limited_log import RateLimitedWarning
from dynamo.planner.config import config_from_mapping
from dynamo.planner.connector_base import DryRunConnector
from dynamo.planner.loop import Planner
from dynamo.planner.metrics import PlannerMetrics
from dynamo.vllm.fpm_metrics import WorkerCollector, WorkerMetrics
from dynamo_fpm_testing.fpm_support import full_record, wait_until
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

NS = "outage"


def _lines(caplog: pytest.LogCaptureFixture, who: str, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(who) and text in r.getMessage()
    ]


async def test_outage_logged_once_each_and_visible_everywhere(
    fresh_nats_server: EmbeddedNatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "dynamo")
    url = fresh_nats_server.url
    template = str(tmp_path / "fpm-{dp_rank}.json")
    tracker = FpmTracker(NS, nats_url=url)
    await tracker.start()
    pub = FpmDirectPublisher(
        namespace=NS, component="backend", worker_id="w1", nats_url=url, stats_file=template.format(dp_rank=0)
    )
    collector = WorkerCollector(template, lambda: 0, lambda: True, {"worker_id": "w1"})
    metrics = WorkerMetrics(collector)
    port = metrics.serve(0, host="127.0.0.1")
    planner_metrics = PlannerMetrics()
    cfg = config_from_mapping({"namespace": NS, "use_model_cards": False, "dry_run": True})
    planner = Planner(cfg, DryRunConnector(), metrics=planner_metrics, transport=tracker.transport)

    def tracker_gauge() -> float | None:
        return planner_metrics.registry.get_sample_value(
            "dynamo_fpm_transport_connected", {"role": "tracker"}
        )

    def health() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return json.loads(resp.read())

    stop_pub = asyncio.Event()

    async def keep_publishing() -> None:  # 100 records/s through the whole outage
        while not stop_pub.is_set():
            pub.publish(full_record("w1"))
            await asyncio.sleep(0.01)

    task = asyncio.ensure_future(keep_publishing())
    try:
        assert await wait_until(lambda: tracker.stats().accepted >= 5, timeout=10)
        assert await wait_until(lambda: health()["fpm_transport"] == "connected", timeout=10)
        await planner.tick()
        assert tracker_gauge() == 1.0
        fresh_nats_server.stop()
        assert await wait_until(lambda: not pub.stats().connected and not tracker.transport().connected, 10)
        assert await wait_until(lambda: health()["fpm_transport"] == "disconnected", timeout=10)
        await planner.tick()
        assert tracker_gauge() == 0.0
        scrape = metrics.expfmt()
        assert 'dynamo_fpm_transport_connected{dp_rank="0",role="publisher",worker_id="w1"} 0.0' in scrape
        await asyncio.sleep(3.0)  # a few seconds of outage, records still handed over
        assert health()["fpm_ranks"]["0"]["down_s"] >= 1.0
        fresh_nats_server.start()
        assert await wait_until(lambda: pub.stats().connected and tracker.transport().connected, 20)
        n = tracker.stats().accepted
        assert await wait_until(lambda: tracker.stats().accepted > n + 5, timeout=10)
        assert await wait_until(lambda: health()["fpm_transport"] == "connected", timeout=10)
        await planner.tick()
        assert tracker_gauge() == 1.0
        assert (
            planner_metrics.registry.get_sample_value("dynamo_fpm_transport_outages", {"role": "tracker"})
            == 1
        )
        st = pub.stats()
        assert st.outages == 1 and st.down_s == 0.0
        assert tracker.transport().outages == 1
    finally:
        stop_pub.set()
        await task
        pub.close()
        await tracker.stop()
        metrics.close()
    # Once each, however many records and reconnect attempts the outage saw.
    assert len(_lines(caplog, "FPM publisher w1/0", "lost its NATS connection")) == 1
    assert len(_lines(caplog, "FPM publisher w1/0", "is back after")) == 1
    assert len(_lines(caplog, f"FPM tracker ({NS})", "lost its NATS connection")) == 1
    assert len(_lines(caplog, f"FPM tracker ({NS})", "is back after")) == 1
    back = _lines(caplog, "FPM publisher w1/0", "is back after")[0]
    assert "dropped meanwhile" in back or "no record dropped" in back
    assert not _lines(caplog, "FPM publisher", "cannot reach")  # it was up at start


async def test_publisher_started_before_nats_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "dynamo")
    server = EmbeddedNatsServer()
    pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id="late", nats_url=server.url)
    try:
        await asyncio.sleep(1.5)  # several connect attempts
        assert not pub.stats().connected and pub.stats().down_s > 1.0
        server.start()
        assert await wait_until(lambda: pub.stats().connected, timeout=10)
    finally:
        pub.close()
        server.close()
    assert len(_lines(caplog, "FPM publisher late/0", "cannot reach NATS")) == 1
    assert len(_lines(caplog, "FPM publisher late/0", "is back after")) == 1
    assert pub.stats().outages == 0  # never lost an established connection


async def test_health_503_until_ready_and_off_without_fpm(tmp_path: Path) -> None:
    ready = [False]
    metrics = WorkerMetrics(WorkerCollector(None, lambda: 0, lambda: ready[0], {"worker_id": "x"}))
    port = metrics.serve(0, host="127.0.0.1")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        assert err.value.code == 503
        ready[0] = True
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ready", "fpm_transport": "off", "fpm_ranks": {}}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert b"dynamo_worker_ready" in resp.read()
    finally:
        metrics.close()


def test_rate_limited_warning_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "rl-test")
    now = [0.0]
    rl = RateLimitedWarning(logging.getLogger("rl-test"), "bad", interval_s=10.0, clock=lambda: now[0])
    for i in range(700):
        now[0] = i * 0.01  # 7 s of messages
        rl.warn("malformed_record" if i % 2 else "wrong_topic")
    now[0] = 12.0
    rl.warn("malformed_record")
    rl.flush()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and rl.total == 701
    assert (
        "699 more suppressed" in msgs[1]
        and "350 malformed_record" in msgs[1]
        and "349 wrong_topic" in msgs[1]
    )


async def test_malformed_flood_over_nats_is_one_warning(
    nats_server: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "dynamo.common.fpm_tracker")
    tracker = FpmTracker(NS, nats_url=nats_server.url, warn_interval=60.0)
    await tracker.start()
    nc = await nats.connect(nats_server.url)
    try:
        subject = fpm_subject(NS, "backend")
        for i in range(700):
            await nc.publish(subject, b"\x00garbage" + bytes([i % 256]))
        await nc.flush()
        assert await wait_until(lambda: tracker.stats().malformed_envelope >= 700, timeout=10)
    finally:
        await nc.close()
        await tracker.stop()  # flushes the suppressed count
    lines = [r.getMessage() for r in caplog.records if "rejected a message" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "699 more suppressed" in lines[1] and "malformed_envelope" in lines[1]
    time.sleep(0)


async def test_unencodable_records_warn_rate_limited(
    nats_server: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "dynamo.common.fpm_publisher")
    pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id="bad", nats_url=nats_server.url)
    try:
        for _ in range(100):
            pub.publish("not a record")  # type: ignore[arg-type]  # the point: a wrong type at run time
        assert await wait_until(lambda: pub.stats().dropped >= 100, timeout=10)
    finally:
        pub.close()
    lines = [r.getMessage() for r in caplog.records if "dropped a record" in r.getMessage()]
    assert len(lines) == 1 and "unencodable record" in lines[0]


def test_transport_health_settings() -> None:
    from dynamo.vllm.health import transport_health_from_env

    assert transport_health_from_env({}) == ("report", 5.0)
    assert transport_health_from_env(
        {"DYN_FPM_TRANSPORT_HEALTH": "gate", "DYN_FPM_TRANSPORT_GRACE": "2"}
    ) == (
        "gate",
        2.0,
    )
    with pytest.raises(ValueError, match="DYN_FPM_TRANSPORT_HEALTH='strict'"):
        transport_health_from_env({"DYN_FPM_TRANSPORT_HEALTH": "strict"})
    with pytest.raises(ValueError, match="DYN_FPM_TRANSPORT_GRACE='-1'"):
        transport_health_from_env({"DYN_FPM_TRANSPORT_GRACE": "-1"})


async def test_gated_health_follows_a_real_outage(
    fresh_nats_server: EmbeddedNatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DYN_FPM_TRANSPORT_HEALTH=gate: NotReady after the grace, Ready again when NATS is back."""
    from dynamo.vllm.health import Readiness, gate_on_transport

    caplog.set_level(logging.WARNING, "dynamo.vllm.health")
    template = str(tmp_path / "fpm-{dp_rank}.json")
    pub = FpmDirectPublisher(
        namespace=NS,
        component="backend",
        worker_id="g",
        nats_url=fresh_nats_server.url,
        stats_file=template.format(dp_rank=0),
    )
    readiness = Readiness()
    readiness.set(True)
    collector = WorkerCollector(template, lambda: 0, readiness, {"worker_id": "g"})
    gate = asyncio.ensure_future(gate_on_transport(readiness, collector.health, grace_s=1.0, poll_s=0.1))
    try:
        assert await wait_until(lambda: collector.health()["fpm_transport"] == "connected", timeout=10)
        assert readiness.healthy()
        fresh_nats_server.stop()
        assert await wait_until(lambda: collector.health()["fpm_transport"] == "disconnected", timeout=10)
        assert readiness.healthy()  # within the grace
        assert await wait_until(lambda: not readiness.healthy(), timeout=10)
        assert readiness()  # the engine itself is still ready (dynamo_worker_ready)
        fresh_nats_server.start()
        assert await wait_until(readiness.healthy, timeout=20)
    finally:
        gate.cancel()
        pub.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert (
        sum("health NotReady" in m for m in msgs) == 1 and sum("health Ready again" in m for m in msgs) == 1
    )
