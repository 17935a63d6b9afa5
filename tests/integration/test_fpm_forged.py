"""Only what discovery vouches for moves the planner; ids, subjects and values have bounds; per-engine
state is capped; decision-log lines have a size limit; subject permissions keep non-workers off FPM.

The end-to-end tests run a real nats-server, the real Dynamo runtime's discovery (file backend, a model
card registered by a served endpoint) and the planner's own loop, tracker and book."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import psutil
import pytest
import pytest_asyncio
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, encode
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_subjects import FPM_TOPIC, EventEnvelope, encode_envelope, fpm_subject
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.common.fpm_validate import record_problem, subject_problem
from dynamo.planner.config import config_from_mapping
from dynamo.planner.connector_base import DryRunConnector
from dynamo.planner.decision_log import MAX_LINE_CHARS, DecisionLog, bounded_line
from dynamo.planner.loop import Planner
from dynamo.planner.observations import NOT_IN_DISCOVERY, WorkerBook
from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.fpm_support import CustomNatsServer, wait_until
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.planner_support import rec, serve_with_card
from msgspec.structs import replace

NS = "forged"
KV_BLOCKS, BLOCK = 100, 32  # the worker's card: 3,200 KV tokens
# RSS growth allowed for 200,000 forged ids (documented in docs/planner.md, "Observe"): the tracker and
# the book hold at most max_engines (10,000) engines, and nats-py's pending buffer is capped at 64 MiB.
RSS_BOUND_MB = 64
RSS_GROWTH_AT_CAP_MB = 16  # once the tracker holds max_engines, more forged ids cost nothing lasting


# ----------------------------------------------------------------------------- bounds, as units


def test_bounds_give_a_reason() -> None:
    ok = rec("w", s_decode=2, s_decode_kv=100)
    assert record_problem(ok) is None and record_problem(ok, kv_tokens=3200) is None
    cases = {
        "empty worker_id": replace(ok, worker_id=""),
        "worker_id over 256 bytes": replace(ok, worker_id="x" * 257),
        "worker_id has control characters": replace(ok, worker_id="a\nb"),
        "dp_rank out of range 0..4095": replace(ok, dp_rank=4096),
        "counter_id out of range": replace(ok, counter_id=-1),
        "wall_time not a finite non-negative number": replace(ok, wall_time=math.inf),
        "wall_time over 3600 s": replace(ok, wall_time=3601.0),
        "over 2^40 queued sum_decode_kv_tokens": rec("w", q_decode=1, q_decode_kv=2**40 + 1),
        "negative scheduled num_decode_requests": rec("w", s_decode=-1),
        "variance not a finite non-negative number": replace(
            ok, queued_requests=replace(ok.queued_requests, var_prefill_length=math.nan)
        ),
    }
    for reason, record in cases.items():
        assert record_problem(record) == reason, reason
    assert record_problem(replace(ok, worker_id="é" * 129)) == "worker_id over 256 bytes"  # bytes, not chars
    assert record_problem(replace(ok, worker_id="é" * 128)) is None
    huge_queue = rec("w", q_decode=10, q_decode_kv=3200 * 1000 + 1)
    assert record_problem(huge_queue) is None  # capacity unknown: only the absolute bounds
    assert record_problem(huge_queue, kv_tokens=3200) == "queued tokens over 1000x the KV capacity"
    assert subject_problem("backend", "generate") is None
    assert subject_problem("c" * 129, "generate") == "component over 128 bytes"


def test_book_without_discovery_keeps_todays_behaviour_but_is_capped() -> None:
    cfg = config_from_mapping({"max_engines": 100, "stale_after_s": 10_000})
    book = WorkerBook(cfg)
    for i in range(1000):
        assert book.ingest("decode", rec(f"w{i}", s_decode=1, s_decode_kv=10), float(i)) == "accepted"
    assert book.engines_held() == 100 and book.stats.evicted == 900
    assert {e.worker_id for e in book.observe(1000.0).decode.engines} == {f"w{i}" for i in range(900, 1000)}


def test_book_with_discovery_counts_the_rest_as_rejected() -> None:
    book = WorkerBook(config_from_mapping({}))
    book.set_discovery("decode", {"real"})
    assert book.ingest("decode", rec("real", s_decode=1, s_decode_kv=10), 0.0) == "accepted"
    assert (
        book.ingest("decode", rec("ghost", q_decode=9, q_decode_kv=9000), 0.0) == "rejected: not in discovery"
    )
    obs = book.observe(0.1)
    assert obs.decode.workers == 1 and obs.decode.rejected == 1
    assert book.stats.rejected == {NOT_IN_DISCOVERY: 1}
    book.set_discovery("decode", set())  # the worker left discovery: dropped at once
    assert book.observe(0.2).decode.workers == 0


def test_decision_log_line_is_bounded() -> None:
    entry = {"pool": "decode", "reason": "x" * 400_000, "signals": {"worker": "w" * 400_000, "n": 1}}
    line = bounded_line(entry)
    assert len(line) <= MAX_LINE_CHARS
    out = json.loads(line)
    assert out["truncated"] is True and out["reason"].endswith("...[truncated]") and out["signals"]["n"] == 1
    small = {"pool": "decode", "reason": "ok", "signals": {}}
    assert json.loads(bounded_line(small)) == small  # untouched, no flag


# ----------------------------------------------------------------------------- against real parts


def _envelope(record: ForwardPassMetrics, seq: int, pid: int = 99) -> bytes:
    return encode_envelope(EventEnvelope(pid, seq, int(time.time() * 1000), FPM_TOPIC, encode(record)))


def _key(decision: Any) -> list[tuple[str, int, int, str]]:
    return [
        (p, decision.pool(p).current, decision.pool(p).desired, decision.pool(p).action)
        for p in ("prefill", "decode")
    ]


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop: the fixture's clients live on it
async def live(
    nats_server: EmbeddedNatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[dict[str, Any]]:
    """A served endpoint with a model card (the real runtime's file discovery), its FPM publisher, and a
    dry-run planner reading discovery through ``ModelCardSource`` and records through ``FpmTracker``."""
    from dynamo.planner.model_cards import ModelCardSource
    from dynamo.runtime import DistributedRuntime

    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "kv"))
    loop = asyncio.get_running_loop()
    rt_worker = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    rt_planner = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    ep, serving = await serve_with_card(
        rt_worker, f"{NS}.backend.generate", kv_blocks=KV_BLOCKS, max_num_seqs=8, context_length=1024
    )
    worker_id = str(ep.connection_id())
    cards = {
        "decode": ModelCardSource(rt_planner, NS, "backend", "generate"),
        "prefill": ModelCardSource(rt_planner, NS, "prefill", "generate"),
    }
    log_path = tmp_path / "decisions.jsonl"
    cfg = config_from_mapping(
        {
            "namespace": NS,
            "dry_run": True,
            "stale_after_s": 60,
            "capacity": {"kv_block_size": BLOCK},
            "prefill": {"min_replicas": 0, "max_replicas": 4},
            "decode": {"min_replicas": 1, "max_replicas": 8},
        }
    )
    log = DecisionLog(log_path)
    planner = Planner(cfg, DryRunConnector(), log=log, cards=cards)
    tracker = FpmTracker(NS, endpoint="generate", nats_url=nats_server.url, stale_after=60)
    tracker.add_listener(planner.on_record)
    await tracker.start()
    pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id=worker_id, nats_url=nats_server.url)
    stop = asyncio.Event()

    async def publish_legit() -> None:  # a steady, moderate decode load: 1,000 of 3,200 KV tokens
        while not stop.is_set():
            pub.publish(rec(worker_id, s_decode=2, s_decode_kv=1000))
            await asyncio.sleep(0.2)

    task = asyncio.ensure_future(publish_legit())
    try:
        deadline = time.monotonic() + 20
        while worker_id not in (planner.book.discovery("decode") or ()):
            assert time.monotonic() < deadline, "model card never listed"
            planner._poll_cards()
            await asyncio.sleep(0.1)
        assert await wait_until(lambda: planner.book.has("decode", worker_id, 0), timeout=10)
        nc = await nats.connect(nats_server.url)
        yield {
            "planner": planner,
            "tracker": tracker,
            "worker_id": worker_id,
            "nc": nc,
            "log_path": log_path,
            "subject": fpm_subject(NS, "backend"),
        }
        await nc.close()
    finally:
        stop.set()
        await task
        pub.close()
        await tracker.stop()
        log.close()
        for source in cards.values():
            source.close()
        serving.cancel()
        rt_planner.shutdown()
        rt_worker.shutdown()


async def _flood(live: dict[str, Any], messages: list[tuple[str, bytes]]) -> None:
    tracker: FpmTracker = live["tracker"]
    before = tracker.stats().received
    nc = live["nc"]
    for i, (subject, data) in enumerate(messages):
        await nc.publish(subject, data)
        if i % 2000 == 1999:
            await nc.flush()
    await nc.flush()
    # The legit worker publishes too: wait for at least the forged messages.
    assert await wait_until(lambda: tracker.stats().received >= before + len(messages), timeout=120)


async def test_forged_records_change_no_decision(live: dict[str, Any]) -> None:
    planner: Planner = live["planner"]
    tracker: FpmTracker = live["tracker"]
    wid, subject = live["worker_id"], live["subject"]
    baseline = _key(await planner.tick())
    assert baseline == [("prefill", 0, 0, "hold"), ("decode", 1, 1, "hold")]

    # Three worker ids no worker registered, claiming a huge decode queue (the report's attack).
    ghosts = [
        (
            subject,
            _envelope(replace(rec(f"ghost-{g}", q_decode=500, q_decode_kv=3000), counter_id=c), c, pid=g),
        )
        for c in range(20)
        for g in range(3)
    ]
    await _flood(live, ghosts)
    assert planner.book.stats.rejected[NOT_IN_DISCOVERY] >= 60
    assert _key(await planner.tick()) == baseline

    # Absurd values, some under the real worker's own id.
    absurd = [
        rec(wid, q_decode=10, q_decode_kv=KV_BLOCKS * BLOCK * 1000 + 1),  # over 1000x its KV capacity
        replace(rec(wid, s_decode=1), wall_time=math.nan),
        rec(wid, q_decode=-5),
        replace(rec(wid), dp_rank=1_000_000),
        rec("ghost-x", q_decode=2**41),
    ]
    await _flood(live, [(subject, _envelope(r, i, pid=7)) for i, r in enumerate(absurd)])
    reasons = dict(planner.book.stats.rejected) | tracker.stats().invalid_reasons
    assert reasons["queued tokens over 1000x the KV capacity"] >= 1
    assert reasons["wall_time not a finite non-negative number"] >= 1
    assert reasons["negative queued num_decode_requests"] >= 1
    assert reasons["dp_rank out of range 0..4095"] >= 1
    assert _key(await planner.tick()) == baseline

    # Oversized fields: a 400 KB worker_id, a 200-byte component token.
    oversized = [
        (subject, _envelope(rec("w" * 400_000, q_decode=9, q_decode_kv=9000), 0, pid=8)),
        (
            f"namespace.{NS}.component.{'c' * 200}.endpoint.generate.forward-pass-metrics",
            _envelope(rec("c1"), 0),
        ),
    ]
    await _flood(live, oversized)
    st = tracker.stats()
    assert (
        st.invalid_reasons["worker_id over 256 bytes"] == 1
        and st.invalid_reasons["component over 128 bytes"] == 1
    )
    assert _key(await planner.tick()) == baseline
    lines = live["log_path"].read_text().splitlines()
    assert lines and max(len(line) for line in lines) <= MAX_LINE_CHARS
    assert all("w" * 300 not in line for line in lines)


async def test_200k_forged_ids_keep_memory_bounded(live: dict[str, Any]) -> None:
    planner: Planner = live["planner"]
    tracker: FpmTracker = live["tracker"]
    subject = live["subject"]
    baseline = _key(await planner.tick())
    proc = psutil.Process(os.getpid())
    gc.collect()
    rss_start = proc.memory_info().rss
    # Warm-up: a first 20,000 ids so that allocator pools and caches exist before the measurement.
    rnd = random.Random(1)
    await _flood(
        live,
        [
            (subject, _envelope(rec(f"warm-{i}", q_decode=9, q_decode_kv=900), 0, pid=i))
            for i in range(20_000)
        ],
    )
    gc.collect()
    rss0 = proc.memory_info().rss
    n = 200_000
    batch = 20_000
    for start in range(0, n, batch):  # built per batch: the test's own list must not be what is measured
        msgs = [
            (
                subject,
                _envelope(rec(f"forged-{rnd.getrandbits(64):x}", q_decode=99, q_decode_kv=99_000), 0, pid=i),
            )
            for i in range(start, start + batch)
        ]
        await _flood(live, msgs)
        del msgs
    gc.collect()
    rss_end = proc.memory_info().rss
    grown_mb = (rss_end - rss0) / 2**20
    total_mb = (rss_end - rss_start) / 2**20
    print(
        f"RSS growth: {total_mb:.1f} MB for all {n + 20_000} forged ids, {grown_mb:.1f} MB for the last {n}"
    )
    assert len(tracker) <= tracker.max_engines
    assert tracker.stats().evicted >= n - tracker.max_engines
    assert planner.book.engines_held() == 1  # only the real worker's engine
    assert planner.book.stats.rejected[NOT_IN_DISCOVERY] >= n
    assert len(planner._restarts) <= 2 * planner.cfg.max_engines
    assert total_mb < RSS_BOUND_MB, f"RSS grew {total_mb:.1f} MB for {n + 20_000} forged ids"
    assert grown_mb < RSS_GROWTH_AT_CAP_MB, f"RSS grew {grown_mb:.1f} MB once the caps were reached"
    assert _key(await planner.tick()) == baseline


async def test_only_workers_may_publish_fpm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented nats-server config (docs/examples/nats-fpm-permissions.conf) on a real server."""
    pw = {"worker": "w-secret", "planner": "p-secret", "observer": "o-secret"}
    for user, secret in pw.items():
        monkeypatch.setenv(f"FPM_{user.upper()}_PASSWORD", secret)
    with CustomNatsServer("-c", str(REPO / "docs" / "examples" / "nats-fpm-permissions.conf")) as server:
        url = f"nats://127.0.0.1:{server.port}"
        monkeypatch.setenv("NATS_AUTH_USERNAME", "planner")
        monkeypatch.setenv("NATS_AUTH_PASSWORD", pw["planner"])
        tracker = FpmTracker(NS, nats_url=url)
        await tracker.start()  # the planner's tracker subscribes as "planner"
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        subject = fpm_subject(NS, "backend")
        forgers = [
            await nats.connect(url, user=u, password=pw[u], error_cb=on_error)
            for u in ("planner", "observer")
        ]
        worker = await nats.connect(url, user="worker", password=pw["worker"])
        try:
            for nc in forgers:
                await nc.publish(subject, _envelope(rec("forged", q_decode=9, q_decode_kv=9000), 0, pid=5))
                await nc.flush()
            await worker.publish(subject, _envelope(rec("real-worker", s_decode=1, s_decode_kv=10), 0, pid=6))
            await worker.flush()
            assert await wait_until(lambda: tracker.stats().accepted >= 1, timeout=10)
            assert await wait_until(lambda: len(errors) >= 2, timeout=10)
            await asyncio.sleep(0.3)
            assert [w.key.worker_id for w in tracker.workers()] == ["real-worker"]
            assert tracker.stats().received == 1
            assert all("permissions violation for publish" in str(e).lower() for e in errors), errors
        finally:
            for nc in [*forgers, worker]:
                await nc.close()
            await tracker.stop()
