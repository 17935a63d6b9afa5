"""Watches the scaling decisions upstream's planner publishes through its virtual connector, for the live
benchmark (``benchmarks/bench_upstream_planner_live.py``).

    python benchmarks/upstream_planner/live_observer.py NAMESPACE

Run with our venv's interpreter (it only needs the ``ai-dynamo-runtime`` 1.6.1 both venvs have), with
``ETCD_ENDPOINTS`` and ``DYN_FILE_KV`` set: the runtime's ``VirtualConnectorCoordinator`` keeps the
decision in etcd, and ``VirtualConnectorClient`` is the public reader a deployment environment uses. One
JSON line on stdout per new decision, ``{"t": epoch s, "decision_id", "prefill", "decode"}``, after a
``{"ready": true}`` line. It never acknowledges a decision (``complete``): nothing starts the extra worker,
so upstream's planner must see the scaling as still in progress. Stops when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(namespace: str) -> None:
    from dynamo._core import VirtualConnectorClient
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    stdin_closed = loop.create_future()

    def on_stdin() -> None:
        if not sys.stdin.buffer.read1(4096) and not stdin_closed.done():
            stdin_closed.set_result(None)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    try:
        client = VirtualConnectorClient(runtime, namespace)
        print(json.dumps({"ready": True}), flush=True)
        seen: int | None = None
        while not stdin_closed.done():
            waiter = asyncio.ensure_future(client.wait())
            done, _ = await asyncio.wait([waiter, stdin_closed], return_when=asyncio.FIRST_COMPLETED)
            if waiter not in done:
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
                break
            event = await client.get()
            if event.decision_id != seen:
                seen = event.decision_id
                row = {
                    "t": time.time(),
                    "decision_id": event.decision_id,
                    "prefill": event.num_prefill_workers,
                    "decode": event.num_decode_workers,
                }
                print(json.dumps(row), flush=True)
            else:
                await asyncio.sleep(0.2)  # an unacknowledged decision wakes every wait
    finally:
        loop.remove_reader(sys.stdin.fileno())
        runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
