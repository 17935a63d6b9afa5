"""Benchmark: aggregated vs disaggregated serving through the Dynamo worker on this machine's CPU.

    .venv/bin/python benchmarks/bench_worker_disagg.py [--requests N] [--gen-tokens N] [--with-binding]
                                                       [--json PATH]

The whole product path, not engines in isolation: an embedded nats-server, Dynamo's HTTP frontend and
``python -m dynamo.vllm`` workers on the tiny model (built on the spot), never more than two workers alive.
Phases, one after the other, each with its own frontend and discovery folder:

- ``agg``: one aggregated worker;
- ``disagg``: a prefill and a decode worker (vLLM's NixlConnector through
  ``dynamo.vllm.cpu_host.nixl_connector``, the worker's defaults, which include
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` on CPU);
- ``disagg-bound`` (only with ``--with-binding``): the same pair with vLLM's default OpenMP binding
  (``VLLM_CPU_OMP_THREADS_BIND=auto``), the configuration whose decode-side reads stalled; each request gets
  at most 60 s, so this phase can take minutes.

For each phase: seconds until the model is ready behind the frontend, then ``--requests`` streamed
completions one at a time, alternating a short and a long prompt (greedy, ``--gen-tokens`` tokens):
time to first token, inter-token latency, request time, how many requests took longer than 20 s (2/3 of
the prefill side's 30 s KV lease: a read that stalled) and how many KV leases expired on the prefill side.
Printed as a table with the disaggregated/aggregated ratio; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from dynamo.common.ports import free_port
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.worker_support import base_env, model_ready, start_frontend, start_worker, wait_until

MODEL = "tiny"
STALL_S = 20.0
PROMPTS = {
    "short": "hello there",
    "long": " ".join(["the cat sat on a mat and it was warm"] * 15),
}
KV = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_module_path": "dynamo.vllm.cpu_host.nixl_connector",
}


def stream_completion(base_url: str, prompt: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed completion; arrival time of every chunk that carries text."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    started = time.monotonic()
    arrivals: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    arrivals.append(time.monotonic() - started)
        ok = True
    except OSError:
        ok = False
    return {"ok": ok, "arrivals": arrivals, "total_s": time.monotonic() - started}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_phase(
    name: str,
    workers: dict[str, list[str]],
    extra_env: dict[str, str],
    model_dir: Path,
    nats_url: str,
    work: Path,
    requests: int,
    gen_tokens: int,
    request_timeout: float,
) -> dict[str, Any]:
    file_kv = work / f"{name}-discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_url, **extra_env)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    procs = [start_frontend(port, env, work / f"{name}-frontend.log")]
    started = time.monotonic()
    try:
        for worker, flags in workers.items():
            log = work / f"{name}-{worker}.log"
            procs.append(start_worker(model_dir, env, log, "--served-model-name", MODEL, *flags))
        wait_until(lambda: model_ready(base_url, MODEL), timeout=600, procs=procs)
        ready_s = time.monotonic() - started
        print(f"[{name}] ready after {ready_s:.1f} s", flush=True)
        results = []
        for i in range(requests):
            kind = "short" if i % 2 == 0 else "long"
            res = stream_completion(base_url, PROMPTS[kind], gen_tokens, request_timeout)
            res["kind"] = kind
            results.append(res)
            ttft = res["arrivals"][0] if res["arrivals"] else float("nan")
            print(
                f"[{name}] request {i + 1}/{requests} ({kind}): ttft {ttft:.3f} s, total "
                f"{res['total_s']:.2f} s" + ("" if res["ok"] else " FAILED"),
                flush=True,
            )
        leases_expired = sum(
            p.log().count("Releasing expired KV blocks") for p in procs if "prefill" in p.log_path.name
        )
    finally:
        for proc in procs:
            proc.stop()
    ttfts = [r["arrivals"][0] for r in results if r["arrivals"]]
    itls = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    totals = [r["total_s"] for r in results]
    return {
        "phase": name,
        "ready_s": ready_s,
        "requests": len(results),
        "failed": sum(not r["ok"] for r in results),
        "stalled": sum(t > STALL_S for t in totals),
        "leases_expired": leases_expired,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_short_p50_s": _pct(
            [r["arrivals"][0] for r in results if r["arrivals"] and r["kind"] == "short"], 0.5
        ),
        "ttft_long_p50_s": _pct(
            [r["arrivals"][0] for r in results if r["arrivals"] and r["kind"] == "long"], 0.5
        ),
        "itl_p50_s": _pct(itls, 0.5),
        "itl_p90_s": _pct(itls, 0.9),
        "total_p50_s": statistics.median(totals) if totals else float("nan"),
        "total_max_s": max(totals) if totals else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10, help="completions per phase (default 10)")
    parser.add_argument("--gen-tokens", type=int, default=16, help="tokens per completion (default 16)")
    parser.add_argument(
        "--with-binding",
        action="store_true",
        help="also run the pair with vLLM's default OpenMP binding (the stalling configuration; slow)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.gen_tokens < 2:
        parser.error("--requests must be >= 1 and --gen-tokens >= 2")

    from dynamo_fpm_testing.tiny_model import build_tiny_model

    pair = {
        "prefill": ["--disaggregation-mode", "prefill", "--kv-transfer-config", json.dumps(KV)],
        "decode": ["--disaggregation-mode", "decode", "--kv-transfer-config", json.dumps(KV)],
    }
    phases: list[tuple[str, dict[str, list[str]], dict[str, str], float]] = [
        ("agg", {"worker": []}, {}, 120.0),
        ("disagg", pair, {}, 120.0),
    ]
    if args.with_binding:
        phases.append(("disagg-bound", pair, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, 60.0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-worker-disagg-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "model")
        nats = EmbeddedNatsServer().start()
        try:
            for name, workers, extra_env, timeout in phases:
                rows.append(
                    run_phase(
                        name,
                        workers,
                        extra_env,
                        model_dir,
                        nats.url,
                        work,
                        args.requests,
                        args.gen_tokens,
                        timeout,
                    )
                )
        finally:
            nats.stop()

    agg = rows[0]
    print()
    print(f"{'phase':<13} {'ready s':>8} {'TTFT p50':>9} {'short':>7} {'long':>7} {'ITL p50':>8} "
          f"{'req p50':>8} {'req max':>8} {'stalled':>8} {'leases':>7} {'TTFT x agg':>10}")  # fmt: skip
    for row in rows:
        ratio = row["ttft_p50_s"] / agg["ttft_p50_s"] if agg["ttft_p50_s"] else float("nan")
        print(
            f"{row['phase']:<13} {row['ready_s']:>8.1f} {row['ttft_p50_s'] * 1e3:>7.0f}ms "
            f"{row['ttft_short_p50_s'] * 1e3:>5.0f}ms {row['ttft_long_p50_s'] * 1e3:>5.0f}ms "
            f"{row['itl_p50_s'] * 1e3:>6.1f}ms {row['total_p50_s']:>7.2f}s {row['total_max_s']:>7.2f}s "
            f"{row['stalled']:>5}/{row['requests']:<2} {row['leases_expired']:>7} {ratio:>10.2f}"
        )
    print(f"(stalled: a request longer than {STALL_S:.0f} s; leases: KV leases the prefill side let expire)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
