"""Cost of the FPM instrumentation on the scheduler hot path, against vLLM's plain AsyncScheduler.

Both schedulers are real vLLM 0.32 schedulers built in this process with the same config (no model:
the model runner's output is faked, outside the timed region). Each holds 64 running decode requests
and 0 / 100 / 1,000 / 10,000 queued ones (new prompts that cannot be admitted: every run slot is
taken). One cycle = ``schedule()`` + ``update_from_output()``; the instrumented one publishes a record
per cycle through the real ``FpmDirectPublisher`` to a real nats-server. Cycles of the two schedulers
are interleaved in short blocks so machine noise hits both alike; the median per scheduler is reported.

    .venv/bin/python benchmarks/bench_scheduler.py [--depths 0,100,1000,10000] [--cycles 600] [--block 10]
        [--remote] [--publisher nats|memory] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DYN_FPM_WORKER_ID", "bench-worker")

RUNNING = 64
PROMPT = 32


def instrumented_cls(publisher: str) -> type:
    from dynamo.vllm.instrumented_scheduler import InstrumentedScheduler

    if publisher == "nats":
        return InstrumentedScheduler
    from dynamo_fpm_testing.scheduler_support import capturing_scheduler_cls

    return capturing_scheduler_cls()


def build(cls: type, model_dir: Path, queued: int, *, remote: bool = False) -> Any:
    from dynamo_fpm_testing.scheduler_support import SchedSpec, make_request, make_scheduler, step

    spec = SchedSpec(
        model_dir,
        num_blocks=65536 if remote else 16384,
        max_num_seqs=RUNNING,
        max_num_batched_tokens=4096,
        max_model_len=4096,
        kv_connector="AsyncLoadTestConnector" if remote else None,
        kv_connector_module_path="dynamo_fpm_testing.kv_connectors" if remote else None,
    )
    sched = make_scheduler(cls, spec)
    if remote:  # park them first (a parked request holds KV blocks but no run slot)
        for i in range(queued):
            sched.add_request(make_request(PROMPT * 2, 64, seed_token=1000 + i, remote_prefill=True))
        step(sched)
    for i in range(RUNNING):
        sched.add_request(make_request(PROMPT, 100_000, seed_token=i))
    for _ in range(3):
        step(sched)
    if not remote:
        for i in range(queued):
            sched.add_request(make_request(PROMPT * 2, 64, seed_token=1000 + i))
        step(sched)
    return sched


CLOCK = time.perf_counter


def cycle(sched: Any) -> float:
    """One timed schedule + update (the fake model output is built outside the timed region)."""
    from dynamo_fpm_testing.scheduler_support import model_output

    clock = CLOCK
    t0 = clock()
    out = sched.schedule()
    t1 = clock()
    mro = model_output(out)
    t2 = clock()
    sched.update_from_output(out, mro)
    t3 = clock()
    return (t1 - t0) + (t3 - t2)


def measure(
    model_dir: Path, depth: int, cycles: int, block: int, remote: bool, publisher: str
) -> dict[str, Any]:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    plain = build(AsyncScheduler, model_dir, depth, remote=remote)
    inst = build(instrumented_cls(publisher), model_dir, depth, remote=remote)
    assert inst.fpm_mode == "incremental", inst.fpm_mode
    for _ in range(20):  # warm-up
        cycle(plain)
        cycle(inst)
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    done = 0
    order = [("plain", plain), ("instrumented", inst)]
    while done < cycles:
        for name, sched in order:
            for _ in range(block):
                times[name].append(cycle(sched))
        order.reverse()  # alternate who goes first: running second is ~1% faster (cache warmth)
        done += block
    queued = inst.fpm_queued_metrics()
    assert queued == inst.fpm_scan_queued()
    expected = depth
    got = queued.num_decode_requests if remote else queued.num_prefill_requests
    assert got == expected, (got, expected)
    published = len(inst._fpm_pub.records) if publisher == "memory" else inst._fpm_pub.stats().published
    plain.shutdown()
    inst.shutdown()
    p = statistics.median(times["plain"]) * 1e6
    i = statistics.median(times["instrumented"]) * 1e6
    # (instrumented block time / plain block time) per block: both halves of a pair ran within milliseconds
    # of each other, so their median is robust to load drifting on a shared machine; quartiles = spread.
    per_block = [
        sum(times["instrumented"][k : k + block]) / sum(times["plain"][k : k + block])
        for k in range(0, len(times["plain"]), block)
    ]
    q1, _, q3 = statistics.quantiles(per_block, n=4)
    return {
        "queued": depth,
        "kind": "remote-kv" if remote else "waiting",
        "plain_us": round(p, 1),
        "instrumented_us": round(i, 1),
        "ratio": round(i / p, 3),
        "paired_ratio": round(statistics.median(per_block), 3),
        "paired_q1": round(q1, 3),
        "paired_q3": round(q3, 3),
        "publisher": publisher,
        "clock": "cpu" if CLOCK is time.thread_time else "wall",
        "records_published": published,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", default="0,100,1000,10000", help="queued depths (comma separated)")
    parser.add_argument("--cycles", type=int, default=600, help="timed cycles per scheduler and depth")
    parser.add_argument("--block", type=int, default=2, help="cycles per interleaved block")
    parser.add_argument(
        "--publisher",
        choices=["nats", "memory"],
        default="nats",
        help="nats: the real FpmDirectPublisher to a local nats-server; "
        "memory: an in-memory list (no thread)",
    )
    parser.add_argument(
        "--remote", action="store_true", help="queued requests wait for remote KV instead (parked)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time (perf_counter); cpu: CPU time of the scheduler thread (thread_time), "
        "immune to other processes on a loaded machine but blind to waits for the GIL",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per depth")
    args = parser.parse_args(argv)

    from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
    from dynamo_fpm_testing.scheduler_support import write_model_config

    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats:
        os.environ["NATS_SERVER"] = nats.url
        model_dir = write_model_config(Path(tmp) / "model")
        rows = [measure(model_dir, d, args.cycles, args.block, args.remote, args.publisher) for d in depths]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(
            f"{'queued':>8} {'kind':>9} {'plain us':>10} {'instr. us':>10} {'ratio':>7} {'paired':>7} "
            f"{'paired quartiles':>17}"
        )
        for r in rows:
            print(
                f"{r['queued']:>8} {r['kind']:>9} {r['plain_us']:>10.1f} {r['instrumented_us']:>10.1f} "
                f"{r['ratio']:>7.3f} {r['paired_ratio']:>7.3f} {r['paired_q1']:>8.3f}-{r['paired_q3']:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
