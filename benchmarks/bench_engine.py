"""Tokens/s of a real vLLM CPU engine with the InstrumentedScheduler against vLLM's plain AsyncScheduler.

Two engines on the tiny model live side by side in this process (each its own EngineCore process,
same config, prefix caching and stats on); the instrumented one publishes every record through the
real ``FpmDirectPublisher`` to a real nats-server. Rounds alternate which engine goes first, and each
round serves the same batch of concurrent requests on one engine, then on the other, so machine noise
hits both alike. Between two batches the benchmark waits ``--settle-s``: after a read, vLLM 0.32's
shared-memory readers spin with ``sched_yield()`` for a second before they park, so without the pause the
engine that just finished takes a core from the one that starts (on 2 cores, per-round ratios scattered
0.55-2.06). Reported: tokens/s per engine per round, the per-round ratio instrumented / plain, its median,
quartiles and spread; and, less touched by other jobs on the machine than wall-clock rates, the CPU seconds
the engine-core process (with its children: on CPU the model runs in it) spent per generated token, per
engine per round, and their per-round ratio (``cpu ratio`` = plain / instrumented CPU per token, so on the
same scale as the tokens/s ratio: below 1 means the instrumented engine costs more).

    .venv/bin/python benchmarks/bench_engine.py [--rounds 10] [--requests 64] [--max-tokens 256]
        [--prompt-tokens 32] [--max-num-seqs 64] [--settle-s 1.5] [--aa] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLAIN = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
INSTRUMENTED = "dynamo.vllm.instrumented_scheduler.InstrumentedScheduler"


def make_engine(model_dir: Path, scheduler_cls: str, max_num_seqs: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        enable_prefix_caching=True,
        disable_log_stats=False,
        max_num_seqs=max_num_seqs,
        seed=0,
        scheduler_cls=scheduler_cls,
    )


def serve(
    llm: Any, prompts: list[Any], params: Any, core: Any = None
) -> tuple[float, int, float, list[float]]:
    """(seconds, tokens generated, CPU seconds of the engine-core process tree, CPU seconds of each of the
    engine-core process's threads, largest first) of one batch served concurrently."""
    cpu0, threads0 = cpu_seconds(core), thread_seconds(core)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    spent = time.perf_counter() - t0
    cpu, threads = cpu_seconds(core) - cpu0, thread_seconds(core)
    per_thread = sorted((v - threads0.get(tid, 0.0) for tid, v in threads.items()), reverse=True)
    return spent, sum(len(o.outputs[0].token_ids) for o in outs), cpu, per_thread


def thread_seconds(proc: Any) -> dict[int, float]:
    """User + system seconds of each thread of ``proc`` (the engine loop, the model's OpenMP threads, the
    publisher's sender, vLLM's I/O threads), by thread id."""
    if proc is None:
        return {}
    return {th.id: th.user_time + th.system_time for th in proc.threads()}


def cpu_seconds(proc: Any) -> float:
    """User + system seconds of ``proc`` and its live children (0 without a process)."""
    if proc is None:
        return 0.0
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except Exception:  # a child that just exited
            continue
        total += times.user + times.system
    return total


def new_engine_core(before: set[int]) -> Any:
    """The engine-core child process started since ``before`` (vLLM titles it ``VLLM::EngineCore``; a helper
    such as multiprocessing's resource tracker may start beside it)."""
    import psutil

    started = [c for c in psutil.Process().children() if c.pid not in before]
    cores = [c for c in started if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    if len(cores) != 1:
        raise RuntimeError(f"expected one new engine-core process, found {[c.name() for c in started]}")
    return cores[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds, each serving one batch on both engines")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests per batch")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (distinct prompts)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engines' running-batch limit")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=1.5,
        help="pause between batches, so the idle engine's readers stop spinning (vLLM: 1 s after a read)",
    )
    ap.add_argument(
        "--aa",
        action="store_true",
        help="A/A control: both engines use the plain AsyncScheduler (the noise floor of every ratio)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the summary and every round as one JSON object to PATH (vLLM logs to stdout)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.requests < 1 or args.max_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--rounds must be >= 2, --requests, --max-tokens and --prompt-tokens >= 1")
    if args.settle_s < 0:
        ap.error("--settle-s must be >= 0")

    from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
    from dynamo_fpm_testing.tiny_model import build_tiny_model
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats:
        from dynamo.vllm.fpm_env import STATS_FILE_NAME
        from dynamo.vllm.fpm_metrics import read_stats

        stats_template = str(Path(tmp) / STATS_FILE_NAME)
        os.environ.update(
            NATS_SERVER=nats.url,
            DYN_NAMESPACE="bench-engine",
            DYN_FPM_WORKER_ID="bench-engine",
            DYN_FPM_STATS_FILE=stats_template,
        )
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        print("starting two engines (about a minute each on 2 cores) ...", file=sys.stderr, flush=True)
        import psutil

        engines: dict[str, Any] = {}
        cores: dict[str, Any] = {}
        for name, cls in (("plain", PLAIN), ("instrumented", PLAIN if args.aa else INSTRUMENTED)):
            before = {c.pid for c in psutil.Process().children()}
            engines[name] = make_engine(model_dir, cls, args.max_num_seqs)
            cores[name] = new_engine_core(before)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        vocab = 200  # the tiny model's vocabulary is larger; distinct prompts, no prefix hits across requests

        def prompts(round_no: int) -> list[Any]:
            return [
                TokensPrompt(
                    prompt_token_ids=[
                        (7 * i + 13 * j + round_no) % vocab + 3 for j in range(args.prompt_tokens)
                    ]
                )
                for i in range(args.requests)
            ]

        for llm in engines.values():  # warm-up, untimed
            serve(llm, prompts(-1), params)
        rows: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ["plain", "instrumented"] if r % 2 == 0 else ["instrumented", "plain"]
            row: dict[str, Any] = {"round": r, "first": order[0]}
            for name in order:
                time.sleep(args.settle_s)
                spent, tokens, cpu, per_thread = serve(engines[name], prompts(r), params, cores[name])
                row[name] = tokens / spent
                row[f"{name}_cpu_us_per_token"] = cpu / tokens * 1e6
                row[f"{name}_thread_cpu_us_per_token"] = [round(s / tokens * 1e6, 2) for s in per_thread[:8]]
            row["ratio"] = row["instrumented"] / row["plain"]
            row["cpu_ratio"] = row["plain_cpu_us_per_token"] / row["instrumented_cpu_us_per_token"]
            rows.append(row)
            print(
                f"round {r}: plain {row['plain']:.0f} tok/s, instrumented {row['instrumented']:.0f} tok/s, "
                f"ratio {row['ratio']:.3f}; CPU per token plain {row['plain_cpu_us_per_token']:.1f} us, "
                f"instrumented {row['instrumented_cpu_us_per_token']:.1f} us, "
                f"cpu ratio {row['cpu_ratio']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(1.5)  # the publisher writes its counters about once a second
        published = int(sum((data.get("published") or 0) for data in read_stats(stats_template).values()))
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    if published == 0 and not args.aa:
        print(
            "error: the instrumented engine published no FPM record; the comparison is void", file=sys.stderr
        )
        return 1
    ratios = sorted(row["ratio"] for row in rows)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    cpu_ratios = sorted(row["cpu_ratio"] for row in rows)
    c1, _, c3 = statistics.quantiles(cpu_ratios, n=4)
    summary = {
        "rounds": rows,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "records_published": published,
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [q1, q3],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "plain_tok_s_median": statistics.median(row["plain"] for row in rows),
        "instrumented_tok_s_median": statistics.median(row["instrumented"] for row in rows),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_quartiles": [c1, c3],
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "plain_cpu_us_per_token_median": statistics.median(row["plain_cpu_us_per_token"] for row in rows),
        "instrumented_cpu_us_per_token_median": statistics.median(
            row["instrumented_cpu_us_per_token"] for row in rows
        ),
        "settle_s": args.settle_s,
        "aa_control": args.aa,
        "load_average_1m": os.getloadavg()[0],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"tokens/s, {args.requests} concurrent requests x {args.max_tokens} tokens, {args.rounds} "
        "rounds:\n"
        f"  plain AsyncScheduler     median {summary['plain_tok_s_median']:.0f}\n"
        f"  InstrumentedScheduler    median {summary['instrumented_tok_s_median']:.0f}\n"
        f"  ratio instrumented/plain median {summary['ratio_median']:.3f} "
        f"(quartiles {q1:.3f}-{q3:.3f}, spread {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}); "
        f"{published} FPM records published to NATS; load average {summary['load_average_1m']:.1f}\n"
        f"engine-core CPU per generated token (user+system, with its children):\n"
        f"  plain AsyncScheduler     median {summary['plain_cpu_us_per_token_median']:.1f} us\n"
        f"  InstrumentedScheduler    median {summary['instrumented_cpu_us_per_token_median']:.1f} us\n"
        f"  cpu ratio plain/instrumented median {summary['cpu_ratio_median']:.3f} "
        f"(quartiles {c1:.3f}-{c3:.3f}, spread {summary['cpu_ratio_min']:.3f}-{summary['cpu_ratio_max']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
