"""Benchmark: aggregated vs disaggregated serving on this machine's CPU (vLLM's NixlConnector over NIXL).

    .venv/bin/python benchmarks/bench_disagg.py [--requests N] [--gen-tokens N] [--short N] [--long N]
                                                [--without-layer | --no-without-layer] [--json PATH]

Real in-process vLLM engines on the tiny model (``dynamo_fpm_testing.disagg_support``), never more than two
alive: a prefill engine and a decode engine, both through ``dynamo.vllm.cpu_host.nixl_connector`` (the CPU
layer, defaults); then, unless ``--no-without-layer``, the decode engine is replaced by one with the layer's
three switches off (vLLM's connector as it is). Aggregated requests run on the prefill engine by itself and
alternate with the disaggregated ones, so both see the same machine load and the same engine settings.

For short and long prompts, one request at a time (greedy, fixed length): time to first token (for
disaggregated: from the prefill engine's arrival to the decode engine's first token, the hop between
the two included), inter-token latency, the prefill engine's time, the decode engine's wait for the KV,
and NIXL's own telemetry for each transfer (duration, bytes). Also the first pull of a new
prefill/decode pair (NIXL handshake) and the idle CPU of each engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from dynamo.common.ports import stable_free_port
from dynamo_fpm_testing.disagg_support import (
    EngineProcess,
    EngineSpec,
    idle_cpu_cores,
    prompt_ids,
    start_engines,
)

FIXES_OFF = {
    "DYN_NIXL_CPU_PROGRESS_DELAY_US": "0",
    "DYN_NIXL_CPU_KEEP_AFFINITY": "0",
    "DYN_NIXL_CPU_SWITCH_INTERVAL": "0",
}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _itl(result: dict[str, Any]) -> list[float]:
    times = result["token_times"]
    return [b - a for a, b in itertools.pairwise(times)]


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        out[f"{key}_p50"] = statistics.median(values)
        out[f"{key}_p90"] = _pct(values, 0.9)
    return out


def _disagg_request(
    prefill: EngineProcess, decode: EngineProcess, rid: str, ids: list[int], gen: int
) -> dict:
    pre = prefill.generate(f"pre-{rid}", ids, 1, kv_transfer_params={"do_remote_decode": True})
    dec = decode.generate(f"dec-{rid}", ids, gen, kv_transfer_params=pre["kv_transfer_params"])
    if dec["finish_reason"] != "length":
        raise RuntimeError(f"decode of {rid} ended with {dec['finish_reason']}")
    transfers = decode.call("transfers")["transfers"]
    return {
        "ttft_s": dec["token_times"][0] - pre["t_arrival"],
        "itl_s": statistics.mean(_itl(dec)),
        "prefill_s": pre["t_finished"] - pre["t_arrival"],
        "decode_wait_s": dec["token_times"][0] - dec["t_arrival"],
        "nixl_xfer_s": sum(t[1] for t in transfers),
        "kv_bytes": float(sum(t[2] for t in transfers)),
    }


def _agg_request(engine: EngineProcess, rid: str, ids: list[int], gen: int) -> dict[str, float]:
    out = engine.generate(f"agg-{rid}", ids, gen)
    return {"ttft_s": out["token_times"][0] - out["t_arrival"], "itl_s": statistics.mean(_itl(out))}


def run_pair(
    prefill: EngineProcess, decode: EngineProcess, sizes: dict[str, int], args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Aggregated and disaggregated requests alternate, so both see the same machine load.

    Aggregated runs on the prefill engine by itself (same engine settings, its connector idle).
    ``seed`` keeps the prompts of each run new to the engines' prefix caches.
    """
    first = _disagg_request(prefill, decode, "first-pull", prompt_ids(40, seed=seed), 2)
    results: dict[str, Any] = {
        "first_pull_decode_wait_s": first["decode_wait_s"],
        "affinity": {"before": decode.ready["affinity_before"], "after": decode.ready["affinity_after"]},
        "switch_interval_s": decode.ready["switch_interval_after"],
    }
    results["idle_cpu_cores"] = dict(
        zip(("prefill", "decode"), idle_cpu_cores([prefill.pid, decode.pid], seconds=2.0), strict=True)
    )
    for label, n in sizes.items():
        _agg_request(prefill, f"warm-{label}", prompt_ids(n, seed=hash((seed, n, -1))), args.gen_tokens)
        _disagg_request(
            prefill, decode, f"warm-{label}", prompt_ids(n, seed=hash((seed, n, -2))), args.gen_tokens
        )
        agg_rows, dis_rows = [], []
        for i in range(args.requests):
            agg_rows.append(
                _agg_request(
                    prefill, f"{label}-{i}", prompt_ids(n, seed=hash((seed, n, i, 0))), args.gen_tokens
                )
            )
            dis_rows.append(
                _disagg_request(
                    prefill,
                    decode,
                    f"{label}-{i}",
                    prompt_ids(n, seed=hash((seed, n, i, 1))),
                    args.gen_tokens,
                )
            )
        results[label] = {"aggregated": _summary(agg_rows), "disaggregated": _summary(dis_rows)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=5, help="measured requests per prompt size (5)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="generated tokens per request (32)")
    parser.add_argument("--short", type=int, default=32, help="short prompt length in tokens (32)")
    parser.add_argument("--long", type=int, default=768, help="long prompt length in tokens (768)")
    parser.add_argument(
        "--without-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run disaggregated with the CPU layer's switches off (default: on)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    from dynamo_fpm_testing.tiny_model import build_tiny_model

    sizes = {"short": args.short, "long": args.long}
    report: dict[str, Any] = {
        "params": vars(args) | {"json": str(args.json) if args.json else None},
        "load_average_at_start": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        prefill, decode = start_engines(
            [
                EngineSpec("prefill", model, "kv_producer", stable_free_port()),
                EngineSpec("decode", model, "kv_consumer", stable_free_port()),
            ],
            work,
        )
        try:
            print("CPU layer on ...", flush=True)
            report["layer_on"] = run_pair(prefill, decode, sizes, args, seed=1000)
            if args.without_layer:
                decode.close()
                (decode,) = start_engines(
                    [EngineSpec("decode-fixes-off", model, "kv_consumer", stable_free_port(), env=FIXES_OFF)],
                    work,
                )
                print("decode engine with the CPU layer's switches off ...", flush=True)
                report["decode_fixes_off"] = run_pair(prefill, decode, sizes, args, seed=2000)
        finally:
            prefill.close()
            decode.close()

    _print(report, sizes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict[str, Any], sizes: dict[str, int]) -> None:
    ms = 1000.0
    load = ", ".join(f"{x:.1f}" for x in report["load_average_at_start"])
    p = report["params"]
    print(
        f"tiny model, one request at a time, {p['gen_tokens']} generated tokens, {p['requests']} requests "
        "per "
        f"size and mode; times in ms (p50 / p90); {report['cpus']} CPUs, load average {load}"
    )
    print(
        f"{'run':<18}{'mode':<15}{'prompt':>7}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}{'ITL p90':>9}"
        f"{'prefill':>9}{'D wait':>8}{'NIXL xfer':>11}{'KV bytes':>10}"
    )
    runs = [r for r in ("layer_on", "decode_fixes_off") if r in report]
    for run in runs:
        for label, n in sizes.items():
            for mode in ("aggregated", "disaggregated"):
                r = report[run][label][mode]
                extra = ""
                if "prefill_s_p50" in r:
                    extra = (
                        f"{r['prefill_s_p50'] * ms:>9.1f}{r['decode_wait_s_p50'] * ms:>8.1f}"
                        f"{r['nixl_xfer_s_p50'] * ms:>11.2f}{r['kv_bytes_p50']:>10.0f}"
                    )
                print(
                    f"{run:<18}{mode:<15}{n:>7}{r['ttft_s_p50'] * ms:>10.1f}{r['ttft_s_p90'] * ms:>10.1f}"
                    f"{r['itl_s_p50'] * ms:>9.2f}{r['itl_s_p90'] * ms:>9.2f}{extra}"
                )
    for run in runs:
        r = report[run]
        print(
            f"{run}: first pull of a new pair {r['first_pull_decode_wait_s'] * ms:.0f} ms; idle CPU "
            f"prefill {r['idle_cpu_cores']['prefill']:.2f} / decode {r['idle_cpu_cores']['decode']:.2f} "
            "cores; "
            f"decode thread affinity {r['affinity']['before']} -> {r['affinity']['after']}; "
            f"decode switch interval {r['switch_interval_s'] * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
