"""The end-of-run report: one self-contained HTML file (inline SVG plots) plus the same plots as PNGs."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .charts import Band, Chart, Marker, Series, render_png, render_svg
from .load import RequestResult, latency_summary
from .signals import Decision, FpmSample
from .verdict import Verdict

BAND_COLORS = {"warmup": "#f3f3f3", "burst": "#fde8e8", "idle": "#eef6ee"}


@dataclass
class ReportData:
    t0: float
    samples: list[FpmSample]
    decisions: list[Decision]
    results: list[RequestResult]
    phase_times: list[tuple[str, float, float]]
    verdict: Verdict
    minimum: dict[str, int]
    settings: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def bucketed(
    samples: list[FpmSample], t0: float, value: Callable[[FpmSample], float | None], width_s: float = 1.0
) -> dict[str, list[tuple[float, float]]]:
    """Per engine, the max of ``value`` in each time bucket (records arrive per step: thousands)."""
    buckets: dict[str, dict[int, float]] = defaultdict(dict)
    for s in samples:
        v = value(s)
        if v is None:
            continue
        name = f"{s.pool}:{_short(s.worker)}" + (f"/{s.dp_rank}" if s.dp_rank else "")
        b = int((s.t - t0) // width_s)
        cur = buckets[name].get(b)
        buckets[name][b] = v if cur is None else max(cur, v)
    return {n: [(b * width_s, v) for b, v in sorted(bs.items())] for n, bs in sorted(buckets.items())}


def pool_sum(
    samples: list[FpmSample],
    t0: float,
    pool: str,
    value: Callable[[FpmSample], float | None],
    width_s: float = 1.0,
) -> list[tuple[float, float]]:
    """Per time bucket, the sum over the pool's engines of each engine's max in that bucket."""
    per_engine = bucketed([s for s in samples if s.pool == pool], t0, value, width_s)
    total: dict[float, float] = defaultdict(float)
    for pts in per_engine.values():
        for x, v in pts:
            total[x] += v
    return sorted(total.items())


def _short(worker: str) -> str:
    return worker if len(worker) <= 10 else worker[-8:]


def replica_series(decisions: list[Decision], t0: float, minimum: dict[str, int], end: float) -> list[Series]:
    out = []
    for pool in ("prefill", "decode"):
        pts = [(0.0, float(minimum.get(pool, 1)))]
        for d in decisions:
            if d.pool == pool and d.is_action:
                pts.append((d.t - t0, float(d.desired)))
        pts.append((end - t0, pts[-1][1]))
        out.append(Series(f"{pool} replicas", pts, step=True))
    return out


def make_charts(data: ReportData) -> list[tuple[str, Chart]]:
    """(file stem, chart) pairs, in report order."""
    t0 = data.t0
    end = (
        max(
            [t0 + 1.0]
            + [s.t for s in data.samples]
            + [d.t for d in data.decisions]
            + [e for _, _, e in data.phase_times]
        )
        + 5.0
    )  # a little room after the last event, so a final step down stays visible
    bands = [Band(s - t0, e - t0, n, BAND_COLORS.get(n, "#f6f6f6")) for n, s, e in data.phase_times]
    if data.phase_times and end - data.phase_times[-1][2] > 6.0:
        bands.append(Band(data.phase_times[-1][2] - t0, end - t0, "settle", "#f6f6f6"))
    actions = [
        Marker(d.t - t0, f"{d.pool} {d.current}->{d.desired}", "#d62728" if d.pool == "decode" else "#1f77b4")
        for d in data.decisions
        if d.is_action
    ]
    prefill = bucketed(
        [s for s in data.samples if s.pool == "prefill"], t0, lambda s: s.queued_prefill_tokens
    )
    decode_q = bucketed(
        [s for s in data.samples if s.pool == "decode"], t0, lambda s: s.queued_decode_requests
    )
    kv_series = [
        Series(
            "decode KV tokens (running)",
            pool_sum(data.samples, t0, "decode", lambda s: s.scheduled_decode_kv_tokens),
        ),
        Series(
            "queued KV: all (incl. preempted)",
            pool_sum(data.samples, t0, "decode", lambda s: s.queued_decode_kv_tokens),
        ),
        Series(
            "queued KV: transfer in flight",
            pool_sum(data.samples, t0, "decode", lambda s: s.kv_transfer_tokens),
        ),
        Series("queued KV: ready", pool_sum(data.samples, t0, "decode", lambda s: s.kv_ready_tokens)),
    ]
    ok = sorted((r for r in data.results if r.ok), key=lambda r: r.start)
    latency = [
        Series("TTFT (s)", [(r.start - t0, r.ttft_s or 0.0) for r in ok]),
        Series("mean ITL x10 (s)", [(r.start - t0, 10 * sum(r.itl_s) / len(r.itl_s)) for r in ok if r.itl_s]),
    ]

    def chart(title: str, series: list[Series], ylabel: str) -> Chart:
        return Chart(title, series, ylabel=ylabel, markers=actions, bands=bands)

    return [
        ("replicas", chart("Replicas per pool (dashed: planner actions)", replica_series(data.decisions, t0, data.minimum, end), "replicas")),
        ("prefill_queue", chart("Prefill pool: queued prefill tokens per engine", [Series(n, p) for n, p in prefill.items()], "tokens")),
        ("decode_queue", chart("Decode pool: queued decode requests per engine", [Series(n, p) for n, p in decode_q.items()], "requests")),
        ("decode_kv", chart("Decode pool: KV tokens (running and queued)", kv_series, "tokens")),
        ("latency", chart("Request latency by start time", latency, "seconds")),
    ]  # fmt: skip


def _fmt_s(v: object) -> str:
    return "-" if v is None else f"{float(v) * 1000:.0f} ms"  # type: ignore[arg-type]


def render_html(data: ReportData, charts: list[tuple[str, Chart]]) -> str:
    e = html.escape
    summary = latency_summary(data.results)
    rows = "".join(
        f"<tr><td>{e(name)}</td><td>{s['requests']}</td><td>{s['failed']}</td><td>{s['cancelled']}</td><td>{s['tokens']}</td>"
        + "".join(f"<td>{_fmt_s(s[k])}</td>" for k in ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99"))
        + "</tr>"
        for name, s in summary.items()
    )  # fmt: skip
    actions = "".join(
        f"<tr><td>+{d.t - data.t0:.1f} s</td><td>{e(d.pool)}</td><td>{d.current} &rarr; {d.desired}</td>"
        f"<td>{e(d.reason)}</td></tr>"
        for d in data.decisions
        if d.is_action
    )
    holds = sum(1 for d in data.decisions if not d.is_action)
    ok = data.verdict.passed
    verdict = "".join(f"<li>{e(line)}</li>" for line in data.verdict.lines)
    notes = "".join(f"<p class=note>{e(n)}</p>" for n in data.notes)
    plots = "".join(f"<div class=plot>{render_svg(c)}</div>" for _, c in charts)
    settings = e(json.dumps(data.settings, indent=2, default=str))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>dynamo-fpm demo report</title>
<style>
body{{font-family:sans-serif;max-width:980px;margin:1em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px}}
.verdict{{border-left:6px solid {"#2ca02c" if ok else "#d62728"};padding:.3em 1em;background:#fafafa}}
.note{{color:#a15c00}}.plot{{margin:1em 0}}
</style></head><body>
<h1>dynamo-fpm demo report</h1>
<div class=verdict><b>Verdict: {"PASS" if ok else "CHECK"}</b><ul>{verdict}</ul></div>
{notes}
<h2>How to read this</h2>
<p>Shaded bands are the load phases (warm-up, the decode-heavy burst, idle). Dashed vertical lines are the
planner's scaling actions (red: decode pool, blue: prefill pool). The burst sends many concurrent long
generations with short prompts: the decode pool's queues and KV grow while the prefill pool's queue stays small,
so the right reaction is to scale decode up, leave prefill alone, and return both to their minimum when idle.
"KV transfer in flight" is decode work waiting for its KV from a prefill worker; "KV ready" waits only for a slot.</p>
{plots}
<h2>Request latency (successful requests)</h2>
<p>TTFT: time to the first streamed token. ITL: a request's mean inter-token latency (first to last token over
the gaps between them); percentiles over requests.</p>
<p>Requests still running when their phase ended were cut off on purpose (client disconnect) and are counted
as "cut off", not as failures; their tokens and timings up to then are included.</p>
<table><tr><th>phase</th><th>requests</th><th>failed</th><th>cut off</th><th>tokens</th><th>TTFT p50</th><th>TTFT p90</th>
<th>TTFT p99</th><th>ITL p50</th><th>ITL p90</th><th>ITL p99</th></tr>{rows}</table>
<h2>Planner actions</h2>
<table><tr><th>time</th><th>pool</th><th>replicas</th><th>reason</th></tr>{actions}</table>
<p>{holds} hold decisions (no change) are in <code>decisions.jsonl</code>.</p>
<h2>Settings</h2><pre>{settings}</pre>
<p>Files in this run folder: <code>logs/</code> (one log per component), <code>fpm.jsonl</code> (every FPM
record, replayable with the planner's replay), <code>decisions.jsonl</code>, <code>requests.jsonl</code>,
<code>report/*.png</code>.</p>
</body></html>
"""


def write_report(data: ReportData, out_dir: Path) -> Path:
    """Write ``report.html`` and one PNG per plot into ``out_dir``; returns the HTML path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = make_charts(data)
    for stem, c in charts:
        (out_dir / f"{stem}.png").write_bytes(render_png(c))
    path = out_dir / "report.html"
    path.write_text(render_html(data, charts), encoding="utf-8")
    return path
