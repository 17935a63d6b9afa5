"""A publishing peer for tests/compat/test_fpm_planes.py, run as its own process.

    python -m dynamo_fpm_testing.fpm_plane_peer {ours|runtime} {nats|zmq} NAMESPACE WORKER_ID

Publishes records with seeds 1..SEEDS over and over (one every 20 ms) until its stdin closes, so that
subscribers that find it late (ZMQ discovery) still see every seed. ``ours``: our engine-process publisher
(``FpmDirectPublisher`` on NATS; on ZMQ ``FpmZmqPublisher`` plus the worker's relay,
``dynamo.vllm.fpm_relay.start_relays``, the runtime's ``FpmEventRelay``), with ``full_record(seed)`` and one
out-of-bounds record per round (``dp_rank`` 99999) for the rejection accounting. ``runtime``: the runtime's
Rust ``FpmDirectPublisher`` with :func:`runtime_fields` of each seed. Prints ``ready`` once publishing.
Environment: ``NATS_SERVER`` (nats), ``DYN_FILE_KV`` (discovery), the loopback ``DYN_*_HOST`` variables.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

from dynamo.common.forward_pass_metrics import ForwardPassMetrics

from dynamo_fpm_testing.fpm_support import full_record

SEEDS = 5
PERIOD_S = 0.02
COMPONENT = "backend"
BAD_DP_RANK = 99999


def runtime_fields(seed: int) -> dict[str, Any]:
    """The keyword arguments of the runtime publisher's ``publish`` for one seed."""
    return dict(
        dp_rank=0,
        scheduled_num_prefill_requests=2 * seed,
        scheduled_sum_prefill_tokens=300 * seed,
        scheduled_sum_prefill_kv_tokens=64 * seed,
        scheduled_num_decode_requests=5 * seed,
        scheduled_sum_decode_kv_tokens=900 * seed,
        queued_num_prefill_requests=4 * seed,
        queued_sum_prefill_tokens=400 * seed,
        queued_num_decode_requests=6 * seed,
        queued_sum_decode_kv_tokens=345 * seed,
        wall_time_secs=0.0125 * seed,
    )


def _stdin_closed() -> threading.Event:
    closed = threading.Event()

    def wait() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait, daemon=True).start()
    return closed


async def main(kind: str, plane: str, namespace: str, worker_id: str) -> None:
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane=plane)
    endpoint = runtime.endpoint(f"{namespace}.{COMPONENT}.generate")
    closed = _stdin_closed()
    relays: list[Any] = []
    if kind == "runtime":
        from dynamo.llm import FpmDirectPublisher as RuntimePublisher

        rt_pub = RuntimePublisher(endpoint, worker_id, dp_size=1)

        def publish(seed: int) -> None:
            rt_pub.publish(**runtime_fields(seed))

        close = rt_pub.shutdown
    else:
        common: dict[str, Any] = dict(namespace=namespace, component=COMPONENT, worker_id=worker_id)
        if plane == "zmq":
            from dynamo.common.event_plane import zmq_fpm_endpoint
            from dynamo.common.fpm_zmq_publisher import FpmZmqPublisher
            from dynamo.common.ports import stable_free_port
            from dynamo.vllm.fpm_relay import start_relays

            port = stable_free_port()
            pub: Any = FpmZmqPublisher(zmq_endpoint=zmq_fpm_endpoint(port), **common)
            await asyncio.sleep(0.2)  # bound before the relay connects, as in the worker
            relays = start_relays(endpoint, port, range(1))
        else:
            from dynamo.common.fpm_publisher import FpmDirectPublisher

            pub = FpmDirectPublisher(**common)

        def publish(seed: int) -> None:
            pub.publish(full_record(worker_id, seed=seed))
            if seed == SEEDS:
                pub.publish(ForwardPassMetrics(worker_id=worker_id, dp_rank=BAD_DP_RANK, wall_time=0.5))

        close = pub.close
    print("ready", flush=True)
    seed = 0
    while not closed.is_set():
        seed = seed % SEEDS + 1
        publish(seed)
        await asyncio.sleep(PERIOD_S)
    close()
    for relay in relays:
        relay.shutdown()
    runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
