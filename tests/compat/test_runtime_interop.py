"""Interoperability with the real Dynamo runtime (ai-dynamo-runtime 1.6.1, event plane on NATS).

Our publisher -> the runtime's ``FpmEventSubscriber`` (recv and tracking modes), and the runtime's
Rust ``FpmDirectPublisher`` -> our tracker, field for field. Each test runs its own runtime against
its own nats-server and discovery folder (constructing one takes ~10 ms once NATS is up).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, decode, is_heartbeat
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_tracker import FpmTracker, WorkerKey
from dynamo_fpm_testing.fpm_support import full_record, wait_until
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

pytestmark = pytest.mark.runtime
NS = "interop"


def upstream_schema(upstream_dir: Path) -> ModuleType:
    """Upstream's schema module under a private name (it would shadow ours as dynamo.common.*)."""
    name = "upstream_fpm_schema_interop"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, upstream_dir / "dynamo/common/forward_pass_metrics.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
async def runtime(
    fresh_nats_server: EmbeddedNatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    monkeypatch.setenv("NATS_SERVER", fresh_nats_server.url)
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "discovery"))
    monkeypatch.setenv("DYN_LOG", "warn")
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="nats")
    try:
        yield rt
    finally:
        rt.shutdown()


RT_FIELDS = dict(
    scheduled_num_prefill_requests=3,
    scheduled_sum_prefill_tokens=1200,
    scheduled_sum_prefill_kv_tokens=256,
    scheduled_num_decode_requests=17,
    scheduled_sum_decode_kv_tokens=4321,
    queued_num_prefill_requests=5,
    queued_sum_prefill_tokens=777,
    queued_num_decode_requests=2,
    queued_sum_decode_kv_tokens=99,
)


async def test_runtime_publisher_read_by_our_tracker(
    runtime: Any, fresh_nats_server: EmbeddedNatsServer
) -> None:
    from dynamo.llm import FpmDirectPublisher as RuntimePublisher

    tracker = FpmTracker(NS, nats_url=fresh_nats_server.url)
    await tracker.start()
    got: list[ForwardPassMetrics] = []
    tracker.add_listener(lambda w, s: got.append(w.record))
    rt_pub = RuntimePublisher(runtime.endpoint(f"{NS}.backend.generate"), "rt-worker", dp_size=2)
    try:
        await asyncio.sleep(0.2)
        for i in range(5):
            fields = {k: v + i for k, v in RT_FIELDS.items()}
            rt_pub.publish(dp_rank=1, wall_time_secs=0.25 + i, **fields)
        assert await wait_until(lambda: sum(r.wall_time > 0 for r in got) >= 5, timeout=10)
        # The runtime's idle heartbeat (after 1 s) is recognised as one.
        assert await wait_until(lambda: any(is_heartbeat(r) and r.dp_rank == 0 for r in got), timeout=10)
    finally:
        rt_pub.shutdown()
        await tracker.stop()
    timing = [r for r in got if r.wall_time > 0]
    for i, r in enumerate(timing):
        s, q = r.scheduled_requests, r.queued_requests
        assert (r.version, r.worker_id, r.dp_rank, r.wall_time) == (1, "rt-worker", 1, 0.25 + i)
        assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (
            3 + i,
            1200 + i,
            256 + i,
        )
        assert (s.num_decode_requests, s.sum_decode_kv_tokens) == (17 + i, 4321 + i)
        assert (q.num_prefill_requests, q.sum_prefill_tokens) == (5 + i, 777 + i)
        assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (2 + i, 99 + i)
        assert s.var_prefill_length == s.var_decode_kv_tokens == q.var_prefill_length == 0.0
        assert q.num_decode_kv_transfer_requests is None  # upstream does not carry our extensions
    assert [r.counter_id for r in timing] == sorted({r.counter_id for r in timing})
    w = tracker.get(WorkerKey("backend", "generate", "rt-worker", 1))
    assert w is not None and w.last_timing_record == timing[-1]
    st = tracker.stats()
    assert st.rejected() == 0 and st.restarts == 0 and st.gaps == 0


async def test_our_publisher_read_by_runtime_subscriber_recv(
    runtime: Any, fresh_nats_server: EmbeddedNatsServer, upstream_dir: Path
) -> None:
    from dynamo.llm import FpmEventSubscriber

    sub = FpmEventSubscriber(runtime.endpoint(f"{NS}.prefill.generate"))
    received: list[bytes | None] = []

    def receiver() -> None:  # recv() blocks (releasing the GIL); returns None once the runtime stops
        while len(received) < 3:
            data = sub.recv()
            received.append(data)
            if data is None:
                return

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    pub = FpmDirectPublisher(
        namespace=NS,
        component="prefill",
        worker_id="ours",
        dp_rank=2,
        nats_url=fresh_nats_server.url,
        heartbeat_interval=60,
    )
    sent = [full_record("ours", 2, seed=i + 1) for i in range(3)]
    try:
        await asyncio.sleep(0.5)  # the subscriber task starts on the first recv()
        for rec in sent:
            pub.publish(rec)
        assert await wait_until(lambda: len(received) >= 3, timeout=10)
    finally:
        pub.close()
    up = upstream_schema(upstream_dir)
    for i, (data, rec) in enumerate(zip(received, sent, strict=True)):
        assert data is not None
        ours = decode(data)
        assert ours == msgspec.structs.replace(rec, counter_id=i)
        theirs = up.decode(data)  # upstream's own decoder: our extensions are ignored
        assert theirs is not None
        assert (theirs.worker_id, theirs.dp_rank, theirs.counter_id, theirs.wall_time) == (
            "ours",
            2,
            i,
            rec.wall_time,
        )
        assert msgspec.to_builtins(theirs.scheduled_requests) == msgspec.to_builtins(rec.scheduled_requests)
        q = msgspec.to_builtins(theirs.queued_requests)
        assert q == {k: v for k, v in msgspec.to_builtins(rec.queued_requests).items() if k in q}


async def test_runtime_tracking_mode_lists_our_worker(
    runtime: Any, fresh_nats_server: EmbeddedNatsServer
) -> None:
    """The upstream planner's path: tracking mode keeps only workers with a model card in discovery."""
    from dynamo.llm import FpmEventSubscriber, ModelInput, ModelType, WorkerType, register_model

    ep = runtime.endpoint(f"{NS}.backend.generate")

    async def handler(request: Any, context: Any = None) -> AsyncIterator[dict]:
        yield {}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    pub = None
    try:
        await asyncio.sleep(0.3)
        await register_model(
            ModelInput.Tensor,
            ModelType.TensorBased,
            ep,
            "interop-model",
            "interop-model",
            worker_type=WorkerType.Decode,
            needs=[[WorkerType.Prefill]],
        )
        worker_id = str(ep.connection_id())
        sub = FpmEventSubscriber(runtime.endpoint(f"{NS}.backend.generate"))
        sub.start_tracking()
        pub = FpmDirectPublisher(
            namespace=NS,
            component="backend",
            worker_id=worker_id,
            nats_url=fresh_nats_server.url,
            heartbeat_interval=60,
        )
        await asyncio.sleep(0.3)
        sent = full_record(worker_id, 0, seed=4)
        pub.publish(sent)
        assert await wait_until(lambda: bool(sub.get_recent_stats()), timeout=10)
        stats = sub.get_recent_stats()
        assert list(stats) == [(worker_id, 0)]
        latest = decode(stats[(worker_id, 0)])
        assert latest is not None and latest.worker_id == worker_id
        assert msgspec.structs.replace(latest, counter_id=0) == sent
    finally:
        if pub is not None:
            pub.close()
        serving.cancel()
