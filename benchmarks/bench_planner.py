"""Benchmark: planner decision time and NATS-to-decision latency.

    .venv/bin/python benchmarks/bench_planner.py [--repeat N] [--samples N] [--json PATH]

1. ``decide()`` (the pure policy) for 1, 100 and 1,000 engines per pool, for the throughput and sla
   targets, with loaded, varied records; and ``observe + decide`` (the book's snapshot, which drops
   stale engines and builds the observation, plus the policy), which is what one live tick costs
   besides the connector. Median and p99 over ``--repeat`` runs. Requirement: < 10 ms at 1,000.
2. NATS-to-decision: a record handed to our ``FpmDirectPublisher`` -> real nats-server -> the FPM
   tracker -> the planner's book -> a decision that uses it. Median and p99 over ``--samples``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from dynamo.planner.config import PlannerConfig, config_from_mapping
from dynamo.planner.observations import WorkerBook
from dynamo.planner.policy import PolicyState, decide

BASE = {
    "capacity": {"context_length": 4096, "kv_tokens": 65536, "max_num_batched_tokens": 2048},
    "prefill": {"max_replicas": 2000},
    "decode": {"max_replicas": 2000},
    "warmup_s": 0,
    "warmup_records": 0,
    "sla": {"min_samples": 5},
}


def record(i: int, pool: str, counter: int = 1) -> ForwardPassMetrics:
    k = i % 17
    if pool == "prefill":
        return ForwardPassMetrics(
            worker_id=f"p{i}",
            counter_id=counter,
            wall_time=0.02 + k * 0.001,
            scheduled_requests=ScheduledRequestMetrics(
                num_prefill_requests=2, sum_prefill_tokens=1024 + 32 * k
            ),
            queued_requests=QueuedRequestMetrics(num_prefill_requests=k, sum_prefill_tokens=200 * k),
        )
    return ForwardPassMetrics(
        worker_id=f"d{i}",
        counter_id=counter,
        wall_time=0.01 + k * 0.0005,
        scheduled_requests=ScheduledRequestMetrics(
            num_decode_requests=8 + k, sum_decode_kv_tokens=20000 + 900 * k
        ),
        queued_requests=QueuedRequestMetrics(
            num_decode_requests=k,
            sum_decode_kv_tokens=300 * k,
            num_decode_kv_transfer_requests=k // 2,
            sum_decode_kv_transfer_tokens=150 * k,
            num_decode_kv_ready_requests=k - k // 2,
            sum_decode_kv_ready_tokens=150 * k,
        ),
    )


def book_with(n: int, cfg: PlannerConfig) -> WorkerBook:
    book = WorkerBook(cfg)
    for c in range(1, 4):
        for i in range(n):
            book.ingest("prefill", record(i, "prefill", c), 1.0 + c * 0.01)
            book.ingest("decode", record(i, "decode", c), 1.0 + c * 0.01)
    return book


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "min_ms": xs[0] * 1e3,
        "median_ms": statistics.median(xs) * 1e3,
        "p99_ms": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3,
    }


def bench_decide(repeat: int) -> list[dict[str, Any]]:
    rows = []
    for target in ("throughput", "sla"):
        cfg = config_from_mapping({**BASE, "target": target})
        for n in (1, 100, 1000):
            book = book_with(n, cfg)
            obs = book.observe(1.1)
            assert len(obs.decode.engines) == n
            decide(obs, PolicyState(), cfg)  # warm
            t_decide, t_tick = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                decide(obs, PolicyState(), cfg)
                t_decide.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                decide(book.observe(1.1), PolicyState(), cfg)
                t_tick.append(time.perf_counter() - t0)
            rows.append(
                {
                    "target": target,
                    "engines_per_pool": n,
                    "decide": _stats(t_decide),
                    "observe_decide": _stats(t_tick),
                }
            )
    return rows


async def bench_latency(samples: int) -> dict[str, Any]:
    from dynamo.common.fpm_publisher import FpmDirectPublisher
    from dynamo.common.fpm_tracker import FpmTracker
    from dynamo.planner.connector_base import DryRunConnector
    from dynamo.planner.loop import Planner
    from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

    with EmbeddedNatsServer() as nats:
        cfg = config_from_mapping(
            {**BASE, "dry_run": True, "namespace": "benchplan", "use_model_cards": False}
        )
        planner = Planner(cfg, DryRunConnector())
        arrived = asyncio.Event()
        expected = [0]

        def listener(worker: Any, subject: str) -> None:
            planner.on_record(worker, subject)
            if (
                worker.key.worker_id == "d0"
                and worker.record.queued_requests.num_decode_requests == expected[0]
            ):
                arrived.set()

        tracker = FpmTracker("benchplan", endpoint="generate", nats_url=nats.url)
        tracker.add_listener(listener)
        await tracker.start()
        pub = FpmDirectPublisher(
            namespace="benchplan", component="backend", worker_id="d0", nats_url=nats.url
        )
        prefill = FpmDirectPublisher(
            namespace="benchplan", component="prefill", worker_id="p0", nats_url=nats.url
        )
        prefill.publish(record(0, "prefill"))
        lat, to_book = [], []
        try:
            for i in range(samples + 5):
                q = 1 + i % 50
                expected[0] = q
                arrived.clear()
                r = ForwardPassMetrics(
                    worker_id="d0",
                    wall_time=0.01,
                    scheduled_requests=ScheduledRequestMetrics(
                        num_decode_requests=4, sum_decode_kv_tokens=60000
                    ),
                    queued_requests=QueuedRequestMetrics(num_decode_requests=q, sum_decode_kv_tokens=100 * q),
                )
                t0 = time.perf_counter()
                pub.publish(r)
                await asyncio.wait_for(arrived.wait(), 5)
                t1 = time.perf_counter()
                d = await planner.tick()
                t2 = time.perf_counter()
                assert d.decode.signals.queued_decode_kv_tokens == 100 * q
                if i >= 5:  # first ones include connection set-up
                    to_book.append(t1 - t0)
                    lat.append(t2 - t0)
                await asyncio.sleep(0.02)
        finally:
            pub.close()
            prefill.close()
            await tracker.stop()
    return {"samples": samples, "publish_to_book": _stats(to_book), "publish_to_decision": _stats(lat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=200, help="decisions timed per size (default 200)")
    ap.add_argument("--samples", type=int, default=100, help="NATS round trips timed (default 100)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    rows = bench_decide(args.repeat)
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (min = the cost without contention)"
    )
    print(
        f"{'target':10} {'engines/pool':>12}   decide min / median / p99 ms   "
        "observe+decide min / median / p99 ms"
    )
    for r in rows:
        d, o = r["decide"], r["observe_decide"]
        print(
            f"{r['target']:10} {r['engines_per_pool']:>12}   {d['min_ms']:>8.3f} {d['median_ms']:>8.3f} "
            f"{d['p99_ms']:>8.3f}"
            f"   {o['min_ms']:>14.3f} {o['median_ms']:>8.3f} {o['p99_ms']:>8.3f}"
        )
    lat = asyncio.run(bench_latency(args.samples))
    b, d = lat["publish_to_book"], lat["publish_to_decision"]
    print(
        f"\nNATS-to-decision ({lat['samples']} samples): publish->book median {b['median_ms']:.2f} ms"
        f" p99 {b['p99_ms']:.2f} ms; publish->decision median {d['median_ms']:.2f} ms "
        f"p99 {d['p99_ms']:.2f} ms"
    )
    worst = max(r["decide"]["min_ms"] for r in rows if r["engines_per_pool"] == 1000)
    worst_med = max(r["decide"]["median_ms"] for r in rows if r["engines_per_pool"] == 1000)
    print(
        f"requirement: decision for 1,000 engines per pool < 10 ms: {'ok' if worst < 10 else 'FAILED'} "
        f"(slowest target: min {worst:.2f} ms, median {worst_med:.2f} ms)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"decide": rows, "latency": lat}, indent=2))
    return 0 if worst < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
