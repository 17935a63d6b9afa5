"""FPM on both of Dynamo's event planes: the interoperability matrix, with real processes.

{our engine-process publisher path, the runtime's Rust ``FpmDirectPublisher``} x {our tracker (what the
planner and the watch CLI read), the runtime's ``FpmEventSubscriber``} x {nats, zmq}. The publisher runs
in its own process (``dynamo_fpm_testing.fpm_plane_peer``); both subscribers run here at once, on a runtime of
their own (file discovery shared with the peer through ``DYN_FILE_KV``), and every record must equal what
was published field for field. Our worker's own row on ZMQ, with real vLLM, is in
``test_worker_zmq_e2e.py::test_worker_publishes_on_the_zmq_plane``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from dynamo.common.event_plane import default_event_plane, resolve_event_plane
from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    decode,
)
from dynamo.common.fpm_tracker import FpmTracker
from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.fpm_plane_peer import BAD_DP_RANK, SEEDS, runtime_fields
from dynamo_fpm_testing.fpm_support import RuntimeReceiver, full_record, wait_until
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

pytestmark = pytest.mark.runtime
PEER_TIMEOUT_S = 60.0


def expected(kind: str, worker_id: str, seed: int) -> ForwardPassMetrics:
    """What a subscriber must decode for one seed (``counter_id`` is stamped by the publisher)."""
    if kind == "ours":
        return full_record(worker_id, seed=seed)
    f = runtime_fields(seed)
    return ForwardPassMetrics(
        worker_id=worker_id,
        dp_rank=f["dp_rank"],
        wall_time=f["wall_time_secs"],
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=f["scheduled_num_prefill_requests"],
            sum_prefill_tokens=f["scheduled_sum_prefill_tokens"],
            sum_prefill_kv_tokens=f["scheduled_sum_prefill_kv_tokens"],
            num_decode_requests=f["scheduled_num_decode_requests"],
            sum_decode_kv_tokens=f["scheduled_sum_decode_kv_tokens"],
        ),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=f["queued_num_prefill_requests"],
            sum_prefill_tokens=f["queued_sum_prefill_tokens"],
            num_decode_requests=f["queued_num_decode_requests"],
            sum_decode_kv_tokens=f["queued_sum_decode_kv_tokens"],
        ),
    )


def seed_of(record: ForwardPassMetrics) -> int:
    return record.scheduled_requests.num_prefill_requests // 2


class Peer:
    """The publishing process; stops when its stdin closes."""

    def __init__(self, kind: str, plane: str, namespace: str, worker_id: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_fpm_testing.fpm_plane_peer", kind, plane, namespace, worker_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    def ready(self) -> bool:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip() == b"ready"

    def stop(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


@pytest.fixture()
def plane_env(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, dict[str, str], str | None]]:
    plane: str = request.param
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "discovery"))
    monkeypatch.setenv("DYN_LOG", "warn")
    server = None
    if plane == "nats":
        server = EmbeddedNatsServer().__enter__()
        monkeypatch.setenv("NATS_SERVER", server.url)
    else:
        monkeypatch.delenv("NATS_SERVER", raising=False)
    try:
        yield plane, dict(os.environ), server.url if server else None
    finally:
        if server is not None:
            server.__exit__(None, None, None)


@pytest.fixture()
async def runtime(plane_env: tuple[str, dict[str, str], str | None]) -> AsyncIterator[Any]:
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane=plane_env[0])
    try:
        yield rt
    finally:
        rt.shutdown()


@pytest.mark.parametrize("plane_env", ["nats", "zmq"], indirect=True)
@pytest.mark.parametrize("kind", ["ours", "runtime"])
async def test_matrix(kind: str, plane_env: tuple[str, dict[str, str], str | None], runtime: Any) -> None:
    plane, env, nats_url = plane_env
    ns, worker_id = f"planes-{kind}-{plane}", f"{kind}-{plane}-worker"
    tracker = FpmTracker(ns, event_plane=plane, runtime=runtime, nats_url=nats_url)
    ours: list[ForwardPassMetrics] = []
    tracker.add_listener(lambda w, subject: ours.append(w.record))
    await tracker.start()
    theirs = RuntimeReceiver(runtime, ns)
    peer = Peer(kind, plane, ns, worker_id, env)
    try:
        assert await asyncio.to_thread(peer.ready)

        def every_seed(records: list[ForwardPassMetrics]) -> bool:
            return {seed_of(r) for r in records if r.wall_time > 0} >= set(range(1, SEEDS + 1))

        assert await wait_until(lambda: every_seed(ours) and every_seed(theirs.records), PEER_TIMEOUT_S), (
            f"ours saw {len(ours)}, the runtime's subscriber {len(theirs.records)}"
        )
    finally:
        code = await asyncio.to_thread(peer.stop)
        theirs.stop()
        await tracker.stop()
    assert code == 0
    for who, records in (("our tracker", ours), ("runtime subscriber", list(theirs.records))):
        timing = [r for r in records if r.wall_time > 0 and r.dp_rank != BAD_DP_RANK]
        assert timing, who
        for r in timing:
            want = msgspec.structs.replace(expected(kind, worker_id, seed_of(r)), counter_id=r.counter_id)
            assert r == want, f"{who} on {plane}: {r} != {want}"
        counters = [r.counter_id for r in records]
        assert counters == sorted(counters), f"{who}: records out of order on {plane}"
    st = tracker.stats()
    assert st.accepted == len(ours) and st.malformed_record == st.malformed_envelope == 0
    if kind == "ours":  # the out-of-bounds record: rejected by reason on either plane, never tracked
        assert st.invalid_reasons.get("dp_rank out of range 0..4095", 0) >= 1, st
        assert all(r.dp_rank != BAD_DP_RANK for r in ours)
        assert any(r.dp_rank == BAD_DP_RANK for r in theirs.records)  # the runtime does not filter


@pytest.mark.parametrize("plane_env", ["nats", "zmq"], indirect=True)
async def test_our_planner_reads_the_plane(plane_env: tuple[str, dict[str, str], str | None]) -> None:
    """``python -m dynamo.planner run --event-plane PLANE`` counts the peer's engine as a decode worker."""
    plane, env, _ = plane_env
    ns = f"planes-planner-{plane}"
    peer = Peer("ours", plane, ns, "planned-worker", env)
    cfg = {"use_model_cards": False, "capacity": {"context_length": 100_000, "kv_tokens": 100_000}}
    planner = subprocess.Popen(
        [sys.executable, "-m", "dynamo.planner", "run", "--namespace", ns, "--dry-run", "--interval", "0.5",
         "--max-ticks", "12", "--json", "--no-tui", "--event-plane", plane, "--config", json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert await asyncio.to_thread(peer.ready)
        out, err = await asyncio.to_thread(planner.communicate, timeout=PEER_TIMEOUT_S)
    finally:
        if planner.poll() is None:
            planner.kill()
            planner.wait()
        await asyncio.to_thread(peer.stop)
    assert planner.returncode == 0, err[-2000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    decode = [r for r in rows if r["pool"] == "decode"]
    assert any(r["signals"].get("workers") == 1 for r in decode), decode[-3:]
    assert all(r["signals"].get("workers", 0) <= 1 for r in rows)  # the out-of-bounds record is no worker


def test_zmq_frames_are_upstreams(upstream_dir: Path) -> None:
    """``[b"", sequence (8 bytes big-endian), record]`` per message, as upstream's scheduler sends and the
    runtime's relay requires (exactly three frames); the record decodes with upstream's schema module."""
    import zmq
    from dynamo.common.event_plane import zmq_fpm_endpoint
    from dynamo.common.fpm_zmq_publisher import FpmZmqPublisher
    from dynamo.common.ports import stable_free_port
    from test_runtime_interop import upstream_schema

    address = zmq_fpm_endpoint(stable_free_port())
    pub = FpmZmqPublisher(zmq_endpoint=address, namespace="z", component="backend", worker_id="w")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(address)
    try:
        frames: list[list[bytes]] = []
        for seed in range(1, 200):  # until the subscription has reached the publisher (slow joiner)
            pub.publish(full_record("w", seed=seed))
            with contextlib.suppress(zmq.Again):
                frames.append(sub.recv_multipart(flags=zmq.NOBLOCK if not frames else 0))
            if len(frames) >= 3:
                break
            time.sleep(0.01)
        assert len(frames) >= 3
        assert pub.stats().connected and pub.stats().last_error is None
        pub.publish(full_record("w", seed=500))
        assert pub.wait_sent(5.0) and pub.stats().queued == 0  # the snapshot hand-over works on ZMQ too
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
    upstream = upstream_schema(upstream_dir)
    sequences = []
    for topic, seq, payload in frames:
        assert topic == b"" and len(seq) == 8
        sequences.append(int.from_bytes(seq, "big"))
        record = decode(payload)
        assert record is not None
        assert record == msgspec.structs.replace(
            full_record("w", seed=seed_of(record)), counter_id=record.counter_id
        )
        theirs = upstream.decode(payload)
        assert (theirs.worker_id, theirs.counter_id, theirs.wall_time) == (
            "w",
            record.counter_id,
            record.wall_time,
        )
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))


def test_zmq_port_taken_is_retried_never_raised() -> None:
    """A port another process holds: the publisher says so in ``last_error`` and binds once it is free."""
    import socket

    from dynamo.common.event_plane import zmq_fpm_endpoint
    from dynamo.common.fpm_zmq_publisher import FpmZmqPublisher
    from dynamo.common.ports import stable_free_port

    port = stable_free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    pub = FpmZmqPublisher(
        zmq_endpoint=zmq_fpm_endpoint(port), namespace="z", component="backend", worker_id="w"
    )
    try:
        pub.publish(full_record("w"))  # queued meanwhile
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not pub.stats().last_error:
            time.sleep(0.02)
        st = pub.stats()
        assert not st.connected and "bind" in (st.last_error or "") and st.queued == 1
        holder.close()
        while time.monotonic() < deadline + 10 and not pub.stats().connected:
            time.sleep(0.02)
        assert pub.stats().connected
    finally:
        holder.close()
        pub.close()


def test_plane_rule() -> None:
    """One rule for every component: the flag, else DYN_EVENT_PLANE, else nats only with a NATS server."""
    assert default_event_plane({}) == "zmq"
    assert default_event_plane({"NATS_SERVER": "nats://h:4222"}) == "nats"
    assert resolve_event_plane(None, {"DYN_EVENT_PLANE": "zmq", "NATS_SERVER": "nats://h"}) == "zmq"
    assert resolve_event_plane("nats", {"DYN_EVENT_PLANE": "zmq"}) == "nats"
    with pytest.raises(ValueError, match="DYN_EVENT_PLANE='kafka'"):
        resolve_event_plane(None, {"DYN_EVENT_PLANE": "kafka"})


def test_worker_engine_port_contract() -> None:
    """The worker picks the engine's PUB port only on ZMQ (the user's first), and the scheduler's settings
    read it: set = publish for the relay, unset = NATS."""
    from dynamo.common.ports import ephemeral_range
    from dynamo.vllm.fpm_env import FpmSettings
    from dynamo.vllm.fpm_relay import fpm_zmq_port

    assert fpm_zmq_port("nats", True, {"DYN_FORWARDPASS_METRIC_PORT": "23456"}) is None
    assert fpm_zmq_port("zmq", False, {}) is None
    assert fpm_zmq_port("zmq", True, {"DYN_FORWARDPASS_METRIC_PORT": "23456"}) == 23456
    picked = {fpm_zmq_port("zmq", True, {}) for _ in range(5)}
    low, high = ephemeral_range()
    assert all(p is not None and not low <= p <= high for p in picked) and len(picked) > 1
    with pytest.raises(ValueError, match="DYN_FORWARDPASS_METRIC_PORT='x'"):
        fpm_zmq_port("zmq", True, {"DYN_FORWARDPASS_METRIC_PORT": "x"})
    assert FpmSettings.from_env({}).zmq_port is None
    assert FpmSettings.from_env({"DYN_FORWARDPASS_METRIC_PORT": "23456"}).zmq_port == 23456


def test_new_names_are_documented() -> None:
    reference = (REPO / "docs" / "configuration.md").read_text()
    names = ("DYN_EVENT_PLANE", "DYN_FORWARDPASS_METRIC_PORT", "--event-plane", "--discovery-backend")
    assert not [n for n in names if f"`{n}" not in reference]
