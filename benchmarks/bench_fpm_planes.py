"""Benchmark: publish-to-receive latency of FPM records on each event plane, at 1,000 records/s.

    .venv/bin/python benchmarks/bench_fpm_planes.py [--seconds S] [--json PATH]

What the ZMQ relay hop costs. Per plane, a publishing process runs two publishers at once, one record
each per millisecond, half a millisecond apart (machine noise hits both alike):

* ``ours``: our engine-process path: on NATS ``FpmDirectPublisher`` straight to the server; on ZMQ
  ``FpmZmqPublisher`` -> loopback PUB -> the runtime's ``FpmEventRelay`` -> the ZMQ event plane (the
  worker's set-up; the relay runs on the runtime's Rust threads, so sharing a process costs it no GIL);
* ``runtime``: the runtime's Rust ``FpmDirectPublisher`` on the same plane (no relay on either plane).

The receiver, in this process, is the runtime's ``FpmEventSubscriber`` in recv mode on a thread, the
same on both planes; each record carries its send time (``time.monotonic_ns() // 1000`` in
``scheduled.sum_prefill_tokens``) and the receive time is taken on return from ``recv()`` (the system's
monotonic clock is shared by the processes). Starts its own nats-server and file discovery folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

NS = "bench-planes"
PERIOD_S = 0.001


def now_us() -> int:
    return time.monotonic_ns() // 1000


# --------------------------------------------------------------------------- publishing process
async def publisher_main(plane: str, seconds: float) -> None:
    from dynamo.common.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics
    from dynamo.llm import FpmDirectPublisher as RuntimePublisher
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane=plane)
    endpoint = runtime.endpoint(f"{NS}.backend.generate")
    relays: list[Any] = []
    common: dict[str, Any] = dict(namespace=NS, component="backend", worker_id="ours")
    if plane == "zmq":
        from dynamo.common.event_plane import zmq_fpm_endpoint
        from dynamo.common.fpm_zmq_publisher import FpmZmqPublisher
        from dynamo.common.ports import stable_free_port
        from dynamo.llm import FpmEventRelay

        port = stable_free_port()
        ours: Any = FpmZmqPublisher(zmq_endpoint=zmq_fpm_endpoint(port), **common)
        time.sleep(0.2)
        relays.append(FpmEventRelay(endpoint, zmq_fpm_endpoint(port)))
    else:
        from dynamo.common.fpm_publisher import FpmDirectPublisher

        ours = FpmDirectPublisher(**common)
    theirs = RuntimePublisher(endpoint, "runtime", dp_size=1)
    zero = dict.fromkeys(
        (
            "scheduled_num_prefill_requests",
            "scheduled_sum_prefill_kv_tokens",
            "scheduled_num_decode_requests",
            "scheduled_sum_decode_kv_tokens",
            "queued_num_prefill_requests",
            "queued_sum_prefill_tokens",
            "queued_num_decode_requests",
            "queued_sum_decode_kv_tokens",
        ),
        0,
    )
    await asyncio.sleep(2.0)  # subscribers find the publishers in discovery
    print("ready", flush=True)
    end = time.monotonic() + seconds
    t = time.monotonic()
    while t < end:
        sched = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=now_us())
        ours.publish(ForwardPassMetrics(worker_id="ours", wall_time=0.001, scheduled_requests=sched))
        t += PERIOD_S / 2
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        theirs.publish(dp_rank=0, scheduled_sum_prefill_tokens=now_us(), wall_time_secs=0.001, **zero)
        t += PERIOD_S / 2
        await asyncio.sleep(max(0.0, t - time.monotonic()))
    await asyncio.sleep(1.0)
    ours.close()
    theirs.shutdown()
    for relay in relays:
        relay.shutdown()
    runtime.shutdown()


# --------------------------------------------------------------------------- receiver (this process)
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure_plane(plane: str, seconds: float, env: dict[str, str]) -> dict[str, list[float]]:
    from dynamo.common.forward_pass_metrics import decode
    from dynamo.llm import FpmEventSubscriber
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane=plane)
    sub = FpmEventSubscriber(runtime.endpoint(f"{NS}.backend.generate"))
    got: list[tuple[int, bytes]] = []

    def recv() -> None:
        while (data := sub.recv()) is not None:
            got.append((now_us(), data))

    thread = threading.Thread(target=recv, daemon=True)
    thread.start()
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", plane, str(seconds)], env=env, stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    assert (await asyncio.to_thread(child.stdout.readline)).strip() == b"ready"
    started = len(got)
    await asyncio.to_thread(child.wait, seconds + 60)
    sub.shutdown()
    thread.join(5)
    runtime.shutdown()
    out: dict[str, list[float]] = {"ours": [], "runtime": []}
    for at, data in got[started:]:
        record = decode(data)
        if record is None or record.wall_time <= 0 or record.worker_id not in out:
            continue
        out[record.worker_id].append((at - record.scheduled_requests.sum_prefill_tokens) / 1000.0)
    return out


async def amain(args: argparse.Namespace) -> int:
    from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

    results: dict[str, dict[str, list[float]]] = {}
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory() as discovery:
        os.environ.update(
            {
                "NATS_SERVER": server.url,
                "DYN_FILE_KV": discovery,
                "DYN_LOG": "error",
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            }
        )
        for plane in ("nats", "zmq"):
            results[plane] = await measure_plane(plane, args.seconds, dict(os.environ))
    print(f"publish-to-receive latency at 1,000 records/s per publisher, {args.seconds:g} s per plane (ms)")
    print(f"{'plane':6} {'publisher':26} {'n':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>8}")
    path = {"nats": "ours: direct to NATS", "zmq": "ours: PUB -> relay -> ZMQ"}
    for plane, by in results.items():
        for who, lat in by.items():
            name = path[plane] if who == "ours" else "runtime Rust publisher"
            print(
                f"{plane:6} {name:26} {len(lat):6d} {pct(lat, 0.5):7.3f} {pct(lat, 0.9):7.3f} "
                f"{pct(lat, 0.99):7.3f} {max(lat, default=float('nan')):8.3f}"
            )
    hop = [pct(results["zmq"]["ours"], q) - pct(results["zmq"]["runtime"], q) for q in (0.5, 0.99)]
    vs_nats = [pct(results["zmq"]["ours"], q) - pct(results["nats"]["ours"], q) for q in (0.5, 0.99)]
    print(f"relay hop (ours on zmq - runtime on zmq): p50 {hop[0]:+.3f} ms, p99 {hop[1]:+.3f} ms")
    print(f"ours on zmq - ours on nats:               p50 {vs_nats[0]:+.3f} ms, p99 {vs_nats[1]:+.3f} ms")
    if args.json:
        summary = {
            plane: {
                who: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99), "mean": statistics.fmean(v)}
                for who, v in by.items()
                if v
            }
            for plane, by in results.items()
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        asyncio.run(publisher_main(sys.argv[2], float(sys.argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="publishing time per plane (default 5)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
