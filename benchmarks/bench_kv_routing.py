"""Benchmark: KV-aware routing (``--router-mode kv``) vs round-robin over the same two workers, on this CPU.

    .venv/bin/python benchmarks/bench_kv_routing.py [--repeats N] [--users N] [--turns N] [--json PATH]

The whole product path: an embedded nats-server, two aggregated ``python -m dynamo.vllm`` workers on the tiny
model publishing vLLM's KV cache events (``--kv-events-config``, each its own port), and two Dynamo frontends
over the same workers, one ``kv`` and one ``round-robin``. Each repeat runs the same multi-turn load through
both frontends, interleaved (the order alternates between repeats), each time with conversations of its own
so no phase reuses another's cache: ``--users`` users at once, each a conversation of ``--turns`` streamed
turns whose prompt is the previous turn's plus new words (a growing shared prefix).

Per phase, from the workers' own vLLM counters (deltas over the phase): prefix-cache hit rate (hit tokens /
queried tokens), prefill tokens computed (queried - hit), requests per worker (how uneven KV routing makes the
load); from the client: TTFT p50/p90, request time p50 and requests/s. Printed per repeat and as the median
(min-max) over repeats; ``--json`` also writes every phase's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dynamo_fpm_testing.kv_routing import (
    MODEL,
    Counters,
    KvStack,
    conversation,
    kv_stack,
    router_events_applied,
)
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.tiny_model import build_tiny_model

MODES = ("round-robin", "kv")


def streamed_turn(base_url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """One streamed completion: (seconds to the first token, seconds to the end)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    started = time.monotonic()
    first: float | None = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic() - started
    ended = time.monotonic() - started
    return (first if first is not None else ended), ended


def user(base_url: str, prompts: list[str], max_tokens: int) -> list[tuple[float, float]]:
    """One user's conversation, turn after turn."""
    return [streamed_turn(base_url, prompt, max_tokens) for prompt in prompts]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(stack: KvStack, mode: str, first_conv: int, args: argparse.Namespace) -> dict[str, Any]:
    """The multi-turn load through one frontend; the workers' counter deltas and the client's timings."""
    conversations = [conversation(first_conv + u, args.turns, 600, 120) for u in range(args.users)]
    before = stack.snapshot()
    applied = router_events_applied(stack.frontends["kv"])
    started = time.monotonic()
    with ThreadPoolExecutor(args.users) as pool:
        results = list(pool.map(lambda p: user(stack.frontends[mode], p, args.gen_tokens), conversations))
    elapsed = time.monotonic() - started
    time.sleep(1.0)  # vLLM counts a request just after its answer left
    deltas = [now.minus(then) for now, then in zip(stack.snapshot(), before, strict=True)]
    total = Counters(*(sum(getattr(d, f) for d in deltas) for f in Counters.__dataclass_fields__))
    ttft = [t for turns in results for t, _ in turns]
    latency = [e for turns in results for _, e in turns]
    requests = len(ttft)
    return {
        "mode": mode,
        "requests": requests,
        "requests_per_worker": [int(d.requests) for d in deltas],
        "hit_rate": total.prefix_hits / total.prefix_queries if total.prefix_queries else 0.0,
        "prefill_tokens_computed": int(total.prefix_queries - total.prefix_hits),
        "prompt_tokens": int(total.prompt_tokens),
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p90_ms": 1000 * quantile(ttft, 0.9),
        "latency_p50_ms": 1000 * statistics.median(latency),
        "requests_per_s": requests / elapsed,
        "router_events_applied": router_events_applied(stack.frontends["kv"]) - applied,
    }


ROW = "{:<12} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}  {}"


def print_row(phase: dict[str, Any]) -> None:
    print(
        ROW.format(
            phase["mode"],
            f"{phase['hit_rate']:.1%}",
            phase["prefill_tokens_computed"],
            f"{phase['ttft_p50_ms']:.1f}",
            f"{phase['ttft_p90_ms']:.1f}",
            f"{phase['latency_p50_ms']:.1f}",
            f"{phase['requests_per_s']:.2f}",
            phase["requests"],
            phase["requests_per_worker"],
        )
    )


def summary(phases: list[dict[str, Any]]) -> None:
    print("\nmedian (min-max) over repeats")
    keys = ("hit_rate", "prefill_tokens_computed", "ttft_p50_ms", "ttft_p90_ms", "requests_per_s")
    for mode in MODES:
        mine = [p for p in phases if p["mode"] == mode]
        parts = []
        for key in keys:
            values = [float(p[key]) for p in mine]
            parts.append(f"{key} {statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        print(f"  {mode:<12} " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--users", type=int, default=4, help="conversations at once")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-routing-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        started = time.monotonic()
        with EmbeddedNatsServer() as nats, kv_stack(work, model, nats.url, modes=MODES) as stack:
            ids = [w.worker_id for w in stack.workers]
            print(f"stack ready in {time.monotonic() - started:.0f} s; workers {ids}")
            print(
                ROW.format(
                    "mode",
                    "hit rate",
                    "prefill",
                    "TTFT p50",
                    "TTFT p90",
                    "req p50",
                    "req/s",
                    "n",
                    "per worker",
                )
            )
            run_phase(stack, "round-robin", 10_000, args)  # warm-up: first requests, connections
            for repeat in range(args.repeats):
                order = MODES if repeat % 2 == 0 else MODES[::-1]
                for mode in order:
                    phase = run_phase(stack, mode, 1000 * (repeat + 1) + 100 * MODES.index(mode), args)
                    phase["repeat"] = repeat
                    phases.append(phase)
                    print_row(phase)
    summary(phases)
    if args.json:
        args.json.write_text(json.dumps(phases, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
