"""The whole planner against a real NATS server and a real etcd, acting through the virtual connector.

Publishers: our library's ``FpmDirectPublisher`` and the Dynamo runtime's own ``FpmDirectPublisher``
(upstream-style records: no transfer/ready split). The "orchestrator" is a real
``VirtualConnectorClient``: it reads each decision, starts or stops publishers, and acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.planner.connector_virtual import VirtualConnector
from dynamo.planner.decision_log import DecisionLog
from dynamo.planner.loop import Planner
from dynamo.planner.policy import Decision
from dynamo_fpm_testing.planner_support import EmbeddedEtcd, config, rec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def runtime_env(monkeypatch: pytest.MonkeyPatch, nats_server: Any, etcd: EmbeddedEtcd) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd.url)
    monkeypatch.setenv("NATS_SERVER", nats_server.url)


def _runtime(loop: asyncio.AbstractEventLoop) -> Any:
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(loop, "etcd", "tcp", event_plane="nats")


class Cluster:
    """Publishers per pool; a driver task publishes the current phase's records every 100 ms."""

    def __init__(self, ns: str, nats_url: str, runtime: Any) -> None:
        self.ns, self.url, self.runtime = ns, nats_url, runtime
        self.phase = "backlog"
        self.workers: dict[str, list[tuple[str, Any]]] = {"prefill": [], "decode": []}
        self._n = {"prefill": 0, "decode": 0}

    def add(self, pool: str, *, runtime_publisher: bool = False) -> None:
        name = f"{pool[0]}{self._n[pool]}"
        self._n[pool] += 1
        if runtime_publisher:
            from dynamo.llm import FpmDirectPublisher as RuntimePublisher

            ep = self.runtime.endpoint(f"{self.ns}.backend.generate")
            self.workers[pool].append((name, ("runtime", RuntimePublisher(ep, name))))
        else:
            comp = "prefill" if pool == "prefill" else "backend"
            pub = FpmDirectPublisher(namespace=self.ns, component=comp, worker_id=name, nats_url=self.url)
            self.workers[pool].append((name, ("ours", pub)))

    def remove(self, pool: str) -> None:
        for i in range(len(self.workers[pool]) - 1, -1, -1):
            _, (kind, pub) = self.workers[pool][i]
            if kind == "ours":  # the runtime's publisher stays: it is the long-lived worker
                pub.close()
                del self.workers[pool][i]
                return
        raise AssertionError(f"no removable {pool} worker")

    def count(self, pool: str) -> int:
        return len(self.workers[pool])

    def _record(self, pool: str, name: str) -> Any:
        if self.phase == "idle":
            return None
        if pool == "prefill":  # 0.45 of context length queued: steady, and 0.9 if consolidated
            return rec(name, wall=0.02, s_prefill=1, s_prefill_tokens=256, q_prefill=2, q_prefill_tokens=450)
        if self.phase == "backlog":  # requests waiting for remote KV: 9,000 queued decode KV tokens
            return rec(name, wall=0.02, s_decode=4, s_decode_kv=2500, q_decode=30, q_decode_kv=9000)
        return rec(name, wall=0.02, s_decode=8, s_decode_kv=7000)

    async def drive(self) -> None:
        while True:
            for pool in ("prefill", "decode"):
                for name, (kind, pub) in list(self.workers[pool]):
                    r = self._record(pool, name)
                    if r is None:
                        continue
                    if kind == "ours":
                        pub.publish(r)
                    else:
                        s, q = r.scheduled_requests, r.queued_requests
                        pub.publish(
                            dp_rank=0,
                            scheduled_num_prefill_requests=s.num_prefill_requests,
                            scheduled_sum_prefill_tokens=s.sum_prefill_tokens,
                            scheduled_sum_prefill_kv_tokens=0,
                            scheduled_num_decode_requests=s.num_decode_requests,
                            scheduled_sum_decode_kv_tokens=s.sum_decode_kv_tokens,
                            queued_num_prefill_requests=q.num_prefill_requests,
                            queued_sum_prefill_tokens=q.sum_prefill_tokens,
                            queued_num_decode_requests=q.num_decode_requests,
                            queued_sum_decode_kv_tokens=q.sum_decode_kv_tokens,
                            wall_time_secs=r.wall_time,
                        )
            await asyncio.sleep(0.1)

    def close(self) -> None:
        for pool in self.workers:
            for _, (kind, pub) in self.workers[pool]:
                if kind == "ours":
                    pub.close()


async def orchestrate(client: Any, cluster: Cluster, acks: list[tuple[int, int]]) -> None:
    """What an external orchestrator does with Dynamo's virtual connector protocol."""
    while True:
        await client.wait()
        d = await client.get()
        for pool, want in (("prefill", d.num_prefill_workers), ("decode", d.num_decode_workers)):
            while want >= 0 and cluster.count(pool) < want:
                cluster.add(pool)
            while want >= 0 and cluster.count(pool) > want:
                cluster.remove(pool)
        acks.append((d.num_prefill_workers, d.num_decode_workers))
        await client.complete(d)


async def test_decode_backlog_scales_decode_then_idle_returns_to_minimum(
    runtime_env: None, nats_server: Any
) -> None:
    from dynamo._core import VirtualConnectorClient

    ns = f"plan{int(time.time() * 1000) % 10**8}"
    cfg = config(
        namespace=ns,
        interval_s=1.0,
        scale_down_stabilization_s=3.0,
        demand_window_s=3.0,
        mismatch_grace_s=4.0,
        stale_after_s=2.5,
        action_timeout_s=30.0,
        gpu_budget=4,
        use_model_cards=False,
        prefill={"min_replicas": 1, "max_replicas": 3},
        decode={"min_replicas": 1, "max_replicas": 3},
    )
    loop = asyncio.get_running_loop()
    runtime = _runtime(loop)
    connector = VirtualConnector(runtime, ns)
    await connector.start()
    decisions: list[Decision] = []
    planner = Planner(cfg, connector, log=DecisionLog(None))
    planner.add_decision_listener(decisions.append)
    tracker = FpmTracker(ns, endpoint="generate", nats_url=nats_server.url, stale_after=cfg.stale_after_s)
    tracker.add_listener(planner.on_record)
    await tracker.start()

    cluster = Cluster(ns, nats_server.url, runtime)
    cluster.add("prefill")
    cluster.add("prefill")
    cluster.add("decode", runtime_publisher=True)  # the Dynamo runtime's own publisher
    acks: list[tuple[int, int]] = []
    client_runtime = _runtime(loop)
    client = VirtualConnectorClient(client_runtime, ns)
    tasks = [asyncio.create_task(cluster.drive()), asyncio.create_task(orchestrate(client, cluster, acks))]
    stop = asyncio.Event()
    try:
        # Let every worker's first records arrive, then run the planner.
        deadline = time.monotonic() + 15
        while (
            planner.book.observe(time.monotonic()).decode.workers < 1
            or planner.book.observe(time.monotonic()).prefill.workers < 2
        ):
            assert time.monotonic() < deadline, "records never arrived"
            await asyncio.sleep(0.05)
        run = asyncio.create_task(planner.run(stop))

        # 1. Decode backlog of requests waiting for remote KV: decode scale-up at the first tick.
        while not decisions:
            await asyncio.sleep(0.05)
        first = decisions[0]
        assert first.decode.action == "scale_up" and first.decode.desired == 2, first.decode.reason
        assert first.prefill.desired == first.prefill.current == 2, first.prefill.reason
        while cluster.count("decode") < 2:
            await asyncio.sleep(0.05)
        cluster.phase = "balanced"
        await asyncio.sleep(4 * cfg.interval_s)
        # The decode backlog never asks for prefill (its light queue may let it shrink after the short
        # stabilization window this test runs with).
        assert all(d.prefill.action != "scale_up" and d.prefill.desired <= 2 for d in decisions), [
            d.prefill.reason for d in decisions
        ]
        assert decisions[-1].decode.current == 2 and decisions[-1].decode.action == "hold", decisions[
            -1
        ].decode.reason

        # 2. Traffic stops: both pools return to their minimum.
        cluster.phase = "idle"
        deadline = time.monotonic() + 30
        while not (
            decisions[-1].prefill.current == 1
            and decisions[-1].decode.current == 1
            and planner.state.prefill.in_flight is None
            and planner.state.decode.in_flight is None
        ):
            assert time.monotonic() < deadline, [(d.prefill.reason, d.decode.reason) for d in decisions[-6:]]
            await asyncio.sleep(0.1)
        assert (cluster.count("prefill"), cluster.count("decode")) == (1, 1)
        assert acks[-1] == (1, 1), acks
        # The GPU budget held at every decision and every command.
        assert all(p + d <= 4 for _, p, d in planner.commands), planner.commands
        assert all(d.prefill.desired + d.decode.desired <= 4 for d in decisions)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cluster.close()
        await tracker.stop()
        client_runtime.shutdown()
        runtime.shutdown()
