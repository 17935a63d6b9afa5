"""The instrumentation's own cost per engine step, without vLLM's: resolves what bench_scheduler.py cannot.

A real InstrumentedScheduler is built with 64 running decode requests and N queued ones (as in
bench_scheduler.py), one real ``schedule()`` output is recorded, then vLLM's ``schedule`` and
``update_from_output`` are replaced by functions that return it at once. What is left per cycle is ours
alone: the batch summary, the queued reconcile, the record, ``publish()`` (an in-memory list here),
``has_requests()``. Measured in CPU time of this thread, so other processes on a shared machine hardly
move it; run it with each version's interpreter to compare them.

    .venv/bin/python benchmarks/bench_hot_path.py [--depth 1000] [--cycles 3000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DYN_FPM_WORKER_ID", "bench-hot-path")
os.environ["DYN_FPM_AUDIT_INTERVAL"] = "0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=1000, help="queued requests")
    parser.add_argument("--cycles", type=int, default=3000, help="cycles per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    import bench_scheduler
    from dynamo_fpm_testing.scheduler_support import model_output, write_model_config
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    with tempfile.TemporaryDirectory() as tmp:
        sched = bench_scheduler.build(
            bench_scheduler.instrumented_cls("memory"), write_model_config(Path(tmp) / "m"), args.depth
        )
    for _ in range(2):
        out = sched.schedule()
        mro = model_output(out)
        sched.update_from_output(out, mro)
    # Replacing vLLM's own methods is the point here (the checker rightly objects elsewhere).
    AsyncScheduler.schedule = lambda self, *a, **k: out
    AsyncScheduler.update_from_output = lambda self, so, m: {}
    records = sched._fpm_pub.records
    per_cycle = []
    for _ in range(args.repeats):
        records.clear()
        t0 = time.thread_time()
        for _ in range(args.cycles):
            sched.update_from_output(sched.schedule(), mro)
        per_cycle.append((time.thread_time() - t0) / args.cycles * 1e6)
    assert len(records) == args.cycles, len(records)
    print(
        f"depth {args.depth}: instrumentation {statistics.median(per_cycle):.2f} us/cycle "
        f"(median of {args.repeats}; min {min(per_cycle):.2f}, max {max(per_cycle):.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
