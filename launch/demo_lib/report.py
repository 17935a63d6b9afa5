"""The end-of-run report: one self-contained HTML file (the figure as an inline base64 PNG) plus the PNG."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.planner.decision_log import DecisionEntry

from . import timeline
from .load import RequestResult, latency_summary
from .signals import ConnectorEvent, FpmSample
from .verdict import Verdict

FIGURE = "timeline.png"


@dataclass
class ReportData:
    t0: float
    samples: list[FpmSample]
    decisions: list[DecisionEntry]
    results: list[RequestResult]
    phase_times: list[tuple[str, float, float]]
    verdict: Verdict
    minimum: dict[str, int]
    settings: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    events: list[ConnectorEvent] = field(default_factory=list)
    planner: bool = True
    baseline: dict[str, object] | None = None  # --compare: the planner-off run's verdict.json


def make_timeline(data: ReportData) -> timeline.Timeline:
    end = (
        max(
            [data.t0 + 1.0]
            + [s.t for s in data.samples]
            + [d.ts for d in data.decisions]
            + [e for _, _, e in data.phase_times]
        )
        + 5.0
    )  # a little room after the last event, so a final step down stays visible
    phases = list(data.phase_times)
    if phases and end - phases[-1][2] > 6.0:
        phases.append(("settle", phases[-1][2], end))
    pools = ("decode",) if data.minimum.get("prefill", 0) == 0 else ("prefill", "decode")
    return timeline.Timeline(
        data.t0,
        end,
        data.samples,
        data.decisions,
        data.results,
        phases,
        data.minimum,
        data.events,
        pools,
        data.verdict.scaled.worker_id if data.verdict.scaled is not None else None,
    )


def _fmt_s(v: object) -> str:
    """Seconds as whole milliseconds; ``-`` for a figure that is missing (None) or not a number."""
    return f"{float(v) * 1000:.0f} ms" if isinstance(v, int | float) else "-"


def _compare_rows(data: ReportData) -> str:
    if data.baseline is None:
        return ""
    e = html.escape
    on = latency_summary(data.results).get("burst", {})
    base_lat = data.baseline.get("latency", {})
    off = base_lat.get("burst", {}) if isinstance(base_lat, dict) else {}
    keys = ("requests", "tokens", "failed", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90")

    def cell(s: Mapping[str, object], k: str) -> str:
        v = s.get(k)
        return _fmt_s(v) if k.startswith(("ttft", "itl")) else e(str(v if v is not None else "-"))

    head = "".join(f"<th>{e(k)}</th>" for k in keys)
    rows = "".join(
        f"<tr><td>{label}</td>" + "".join(f"<td>{cell(s, k)}</td>" for k in keys) + "</tr>"
        for label, s in (("planner on", on), ("planner off", off))
    )
    return (
        "<h2>The same load with the planner off (--compare)</h2>"
        f"<table><tr><th>burst</th>{head}</tr>{rows}</table>"
    )


def _event_rows(data: ReportData) -> str:
    e = html.escape
    shown = [ev for ev in data.events if ev.event != "state" or ev.state in ("standby", "serving")]
    return "".join(
        f"<tr><td>{ev.t - data.t0:+.1f} s</td><td>{e(ev.pool)} {ev.index}</td><td>{e(ev.event)}"
        f"{' ' + e(ev.state) if ev.state else ''}</td><td>{e(ev.worker_id)}</td></tr>"
        for ev in shown
    )


def render_html(data: ReportData, png: bytes) -> str:
    e = html.escape
    summary = latency_summary(data.results)
    percentiles = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99")
    rows = "".join(
        f"<tr><td>{e(name)}</td><td>{s['requests']}</td><td>{s['failed']}</td><td>{s['cancelled']}</td>"
        f"<td>{s['tokens']}</td>"
        + "".join(f"<td>{_fmt_s(s[k])}</td>" for k in percentiles)
        + "</tr>"
        for name, s in summary.items()
    )  # fmt: skip
    actions = "".join(
        f"<tr><td>+{d.ts - data.t0:.1f} s</td><td>{e(d.pool)}</td><td>{d.current} &rarr; {d.desired}</td>"
        f"<td>{e(d.reason)}</td></tr>"
        for d in data.decisions
        if d.is_action
    )
    holds = sum(1 for d in data.decisions if not d.is_action)
    ok = data.verdict.passed and data.planner
    lines = data.verdict.lines if data.planner else ("The planner was off: this is the baseline run.",)
    verdict = "".join(f"<li>{e(line)}</li>" for line in lines)
    notes = "".join(f"<p class=note>{e(n)}</p>" for n in data.notes)
    image = base64.b64encode(png).decode()
    plots = f'<div class=plot><img alt="timeline" src="data:image/png;base64,{image}"></div>'
    settings = e(json.dumps(data.settings, indent=2, default=str))
    events = _event_rows(data)
    compare = _compare_rows(data)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>dynamo-fpm demo report</title>
<style>
body{{font-family:sans-serif;max-width:980px;margin:1em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px}}
.verdict{{border-left:6px solid {"#2ca02c" if ok else "#d62728"};padding:.3em 1em;background:#fafafa}}
.note{{color:#a15c00}}.plot{{margin:1em 0}}.plot img{{width:100%}}
</style></head><body>
<h1>dynamo-fpm demo report</h1>
<div class=verdict><b>Verdict: {"PASS" if ok else "CHECK"}</b><ul>{verdict}</ul></div>
{notes}
{compare}
<h2>How to read this</h2>
<p>Every panel shares one time axis: seconds since the load began. Shaded bands are the load phases (warm-up,
the decode-heavy burst, idle, settle). Dashed vertical lines are the planner's scaling actions (red: decode
pool, blue: prefill pool), labelled with their reasons in the top panel. The replica panels draw the planner's
<i>desired</i> count next to what really ran: replicas <i>registered</i> (publishing forward-pass metrics),
replicas <i>serving</i> (scheduling work in the last few seconds), and the connector's workers still
<i>starting</i> and its warm <i>standbys</i> (loaded, not registered). The burst sends many concurrent long
generations with short prompts: the decode pool's queues and KV grow while the prefill pool's queue stays
small, so the right reaction is to scale decode up, leave prefill alone, and return both to their minimum when
idle; the "decode tokens/s per engine" panel shows whether the added replica really took its share.
"KV in transfer" is decode work waiting for its KV from a prefill worker; "KV ready" waits only for a
slot.</p>
{plots}
<h2>Request latency (successful requests)</h2>
<p>TTFT: time to the first streamed token. ITL: a request's mean inter-token latency (first to last token over
the gaps between them); percentiles over requests.</p>
<p>Requests still running when their phase ended were cut off on purpose (client disconnect) and are counted
as "cut off", not as failures; their tokens and timings up to then are included.</p>
<table><tr><th>phase</th><th>requests</th><th>failed</th><th>cut off</th><th>tokens</th><th>TTFT p50</th>
<th>TTFT p90</th><th>TTFT p99</th><th>ITL p50</th><th>ITL p90</th><th>ITL p99</th></tr>{rows}</table>
<h2>Planner actions</h2>
<table><tr><th>time</th><th>pool</th><th>replicas</th><th>reason</th></tr>{actions}</table>
<p>{holds} hold decisions (no change) are in <code>decisions.jsonl</code>.</p>
<h2>The planner's workers</h2>
<p>Events of the planner's local connector (<code>logs/local-connector-events.jsonl</code>): workers started,
standbys warm, promoted, serving, parked or stopped.</p>
<table><tr><th>time</th><th>worker</th><th>event</th><th>worker id</th></tr>{events}</table>
<h2>Settings</h2><pre>{settings}</pre>
<p>Files in this run folder: <code>logs/</code> (one log per component), <code>fpm.jsonl</code> (every FPM
record, replayable with the planner's replay), <code>decisions.jsonl</code>, <code>requests.jsonl</code>,
<code>report/timeline.png</code>.</p>
</body></html>
"""


def write_report(data: ReportData, out_dir: Path) -> Path:
    """Write ``report.html`` and the figure (``timeline.png``) into ``out_dir``; returns the HTML path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = timeline.render(make_timeline(data))
    (out_dir / FIGURE).write_bytes(png)
    path = out_dir / "report.html"
    path.write_text(render_html(data, png), encoding="utf-8")
    return path
