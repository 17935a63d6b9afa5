"""The self-contained HTML report of ``python -m dynamo.planner simulate --report DIR``.

One file a reviewer can open anywhere (a CI artifact, a mail attachment): the chart is a PNG embedded as a
base64 data URI, the CSS is inline, nothing is fetched. Beside it, ``summary.json`` and ``timeline.json``
keep the numbers for scripts.

The chart is one matplotlib figure with four panels sharing the time axis, so a scaling action can be read
against the replica counts, the queues that drove it and the SLA attainment that followed. It is drawn with
``matplotlib.figure.Figure`` on the Agg canvas directly: no pyplot, no global backend state, safe to call from
any thread or a test. A run of thousands of ticks and tens of thousands of requests stays well under two
seconds because every series is one vectorised artist (lines, step patches, line collections), never one
artist per point.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, MaxNLocator

__all__ = ["BIN_S", "render_figure", "render_html", "write_report"]

# Width of the SLA-attainment bins, by request arrival time.
BIN_S = 10.0
POOLS = ("prefill", "decode")
COLOURS = {"prefill": "#1f77b4", "decode": "#ff7f0e"}
DPI = 100

Array = npt.NDArray[np.float64]


def write_report(result: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> pathlib.Path:
    """Write ``summary.json``, ``timeline.json`` and ``report.html`` into *out_dir*; return the HTML's path.

    The JSON files come first so the numbers survive even if drawing fails on some odd input.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(result.get("summary") or {})
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    # Compact: a long run has tens of thousands of requests, indentation would triple the file.
    (out / "timeline.json").write_text(json.dumps(result, separators=(",", ":"), default=str) + "\n")
    png = render_figure(result)
    path = out / "report.html"
    path.write_text(render_html(result, png), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- the figure


def _series(ticks: Sequence[Mapping[str, Any]], pool: str, key: str) -> Array:
    """One per-tick field of one pool as floats; a missing field reads as NaN (a gap), not as zero.

    The last value is repeated once more, to pair with the run's end appended to the tick times: a
    post-step line then shows the last tick's state until the end of the run instead of stopping short.
    """
    out = np.full(len(ticks) + 1, np.nan)
    for i, tick in enumerate(ticks):
        value = (tick.get(pool) or {}).get(key)
        if value is not None:
            out[i] = float(value)
    if ticks:
        out[-1] = out[-2]
    return out


def _attainment(requests: Sequence[Mapping[str, Any]], t_end: float) -> tuple[Array, Array, Array]:
    """Bin edges, requests per bin and the percentage of them that met both SLA bounds (NaN where empty).

    Binned by *arrival*: a request that arrived during a burst counts against the burst even if it
    completed (or timed out) long after.
    """
    if not requests:
        return np.zeros(1), np.zeros(0), np.zeros(0)
    arrivals = np.fromiter((float(r.get("arrival_s") or 0.0) for r in requests), float, len(requests))
    ok = np.fromiter((bool(r.get("ok")) for r in requests), bool, len(requests))
    n_bins = max(1, math.ceil(max(t_end, float(arrivals.max())) / BIN_S))
    idx = np.clip((arrivals // BIN_S).astype(np.int64), 0, n_bins - 1)
    counts = np.bincount(idx, minlength=n_bins).astype(float)
    met = np.bincount(idx, weights=ok.astype(float), minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        pct = np.where(counts > 0, 100.0 * met / counts, np.nan)
    return np.arange(n_bins + 1, dtype=float) * BIN_S, counts, pct


def _steps(ax: Axes, t: Array, y: Array, **kw: Any) -> None:
    """A per-tick value holds until the next tick: draw it as a post-step line."""
    ax.plot(t, y, drawstyle="steps-post", **kw)


def _no_data(ax: Axes, text: str, hide_y: bool = True) -> None:
    """Say why a panel is empty rather than leave a blank frame (or a meaningless 0..1 scale)."""
    if hide_y:
        ax.tick_params(axis="y", labelleft=False)
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#888", fontsize=10)


def _legend(ax: Axes, handles: list[Any] | None = None, x: float = 1.01) -> None:
    """Legends go outside the plot area, on the right, so they never hide a curve."""
    if handles is None:
        handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(x, 1.0), fontsize=8, frameon=False)


def _action_markers(axes: Iterable[Axes], actions: Sequence[Mapping[str, Any]]) -> list[Line2D]:
    """Vertical lines at each action across every panel: colour = pool, solid = up, dotted = down.

    Returns legend handles for the kinds that occurred.
    """
    handles: list[Line2D] = []
    groups: dict[tuple[str, bool], list[float]] = {}
    for a in actions:
        pool = str(a.get("pool"))
        up = float(a.get("to") or 0) > float(a.get("from") or 0)
        groups.setdefault((pool, up), []).append(float(a.get("t_s") or 0.0))
    alpha = 0.6 if len(actions) <= 60 else 0.3  # hundreds of markers must not hide the curves
    for (pool, up), times in sorted(groups.items()):
        colour = COLOURS.get(pool, "#555")
        style: Literal["-", ":"] = "-" if up else ":"
        for ax in axes:
            ax.vlines(
                times,
                0,
                1,
                transform=ax.get_xaxis_transform(),
                colors=colour,
                linestyles=style,
                linewidth=0.9,
                alpha=alpha,
                zorder=0.5,
            )
        arrow = "\u2191" if up else "\u2193"
        handles.append(Line2D([], [], color=colour, linestyle=style, label=f"{pool} scale {arrow}"))
    return handles


def render_figure(result: Mapping[str, Any]) -> bytes:
    """The four-panel timeline as PNG bytes (see the module docstring for why one figure)."""
    summary: Mapping[str, Any] = result.get("summary") or {}
    ticks: Sequence[Mapping[str, Any]] = result.get("ticks") or []
    actions: Sequence[Mapping[str, Any]] = result.get("actions") or []
    requests: Sequence[Mapping[str, Any]] = result.get("requests") or []

    t = np.fromiter((float(k.get("t_s") or 0.0) for k in ticks), float, len(ticks))
    t_end = max(
        float(summary.get("duration_s") or 0.0),
        float(t.max()) if t.size else 0.0,
        max((float(a.get("t_s") or 0.0) for a in actions), default=0.0),
    )
    t = np.append(t, max(t_end, float(t[-1]))) if t.size else t  # the run's end, see _series

    fig = Figure(figsize=(13, 11), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [1.3, 1, 1, 1.1]})
    ax_rep, ax_pq, ax_dq, ax_sla = (axes[i] for i in range(4))

    # (1) replicas
    ax_rep.set_title("Replicas per pool", loc="left", fontsize=10)
    ax_rep.set_ylabel("replicas")
    if t.size:
        # Prefill is drawn wide and pale under a narrow decode line, so equal counts stay readable.
        widths = {"prefill": 3.6, "decode": 1.5}
        for pool in POOLS:
            c, lw = COLOURS[pool], widths[pool]
            active = np.nan_to_num(_series(ticks, pool, "active"))
            starting = np.nan_to_num(_series(ticks, pool, "starting"))
            draining = np.nan_to_num(_series(ticks, pool, "draining"))
            _steps(ax_rep, t, active, color=c, linewidth=lw, alpha=0.75, label=f"{pool} active", zorder=3)
            # Stacked on top of active: what the pool holds (and pays for) is active + starting + draining.
            for lo, hi, hatch, what in (
                (active, active + starting, "///", "starting"),
                (active + starting, active + starting + draining, "...", "draining"),
            ):
                if (hi > lo).any():
                    ax_rep.fill_between(
                        t, lo, hi, step="post", facecolor="none", edgecolor=c, hatch=hatch, linewidth=0.0,
                        alpha=0.8, label=f"{pool} {what} (stacked)", zorder=2,
                    )  # fmt: skip
            _steps(
                ax_rep,
                t,
                _series(ticks, pool, "desired"),
                color=c,
                linewidth=1.1 if pool == "decode" else 2.0,
                linestyle="--", label=f"{pool} desired", zorder=4,
            )  # fmt: skip
        ax_rep.set_ylim(bottom=0)
        ax_rep.yaxis.get_major_locator().set_params(integer=True)
    else:
        _no_data(ax_rep, "no planner ticks recorded")

    # (2), (3) queues; thousands of points get a thinner line or they merge into a solid block
    dense = 1.2 if t.size <= 600 else 0.6
    tokens = EngFormatter(sep="")
    for ax, key, title in (
        (ax_pq, "queued_prefill_tokens", "Queued prefill tokens"),
        (ax_dq, "queued_decode_kv_tokens", "Queued decode KV tokens"),
    ):
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel("tokens")
        if t.size:
            ax.yaxis.set_major_formatter(tokens)
            for pool in POOLS:
                _steps(
                    ax,
                    t,
                    _series(ticks, pool, key),
                    color=COLOURS[pool],
                    linewidth=dense,
                    label=f"{pool} pool",
                )
            ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1.0))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole tokens: no "200m" on an empty queue
        else:
            _no_data(ax, "no planner ticks recorded")

    # (4) SLA attainment by arrival bin
    ttft, itl = summary.get("sla_ttft_ms"), summary.get("sla_itl_ms")
    bounds = ""
    if isinstance(ttft, int | float) and isinstance(itl, int | float):
        bounds = f" (TTFT \u2264 {ttft:.0f} ms and ITL \u2264 {itl:.0f} ms)"
    ax_sla.set_title(
        f"SLA attainment of requests by arrival, {BIN_S:.0f} s bins{bounds}", loc="left", fontsize=10
    )
    ax_sla.set_ylabel("met both bounds (%)")
    ax_sla.set_xlabel("time (s)")
    edges, counts, pct = _attainment(requests, t_end)
    sla_handles: list[Any] = []
    if counts.size:
        ax_n = ax_sla.twinx()
        ax_n.stairs(counts, edges, fill=True, color="#bbbbbb", alpha=0.45, zorder=0)
        ax_n.set_ylabel("requests per bin", color="#777")
        ax_n.tick_params(axis="y", colors="#777", labelsize=8)
        ax_n.set_ylim(0, max(1.0, float(counts.max())) * 1.15)
        ax_sla.set_zorder(ax_n.get_zorder() + 1)  # attainment line over the bars
        ax_sla.patch.set_visible(False)
        y = np.append(pct, pct[-1])
        lw = 1.5 if counts.size <= 600 else 0.7
        (line,) = ax_sla.plot(edges, y, drawstyle="steps-post", color="#2ca02c", linewidth=lw)
        line.set_label("attainment")
        sla_handles = [line, Patch(facecolor="#bbbbbb", alpha=0.45, label="requests / bin")]
    else:
        _no_data(ax_sla, "no requests recorded", hide_y=False)
    goodput = _goodput_pct(summary, requests)
    if goodput is not None:
        gl = ax_sla.axhline(goodput, color="#d62728", linestyle="--", linewidth=1.3, zorder=5)
        gl.set_label(f"run goodput {goodput:.1f} %")
        sla_handles.append(gl)
    ax_sla.set_ylim(0, 105)

    marker_handles = _action_markers(axes, actions)
    _legend(ax_rep, ax_rep.get_legend_handles_labels()[0] + marker_handles)
    _legend(ax_pq)
    _legend(ax_dq)
    _legend(ax_sla, sla_handles, x=1.07 if counts.size else 1.01)
    for ax in axes:
        ax.grid(True, alpha=0.25, linewidth=0.6)
        ax.tick_params(labelsize=8)
    ax_sla.set_xlim(0, max(t_end, float(edges[-1]) if counts.size else 0.0, 1.0))

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- the HTML

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1340px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.facts { color: #555; margin: 0 0 16px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 4px 10px; text-align: left; }
th { background: #f4f4f4; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #b00; font-weight: 600; } .good { color: #070; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
details { margin-top: 12px; } .muted { color: #777; }
"""

# Summary keys shown in the main table or the header; the rest go to the "all summary fields" list.
_SHOWN = {
    "requests",
    "completed_requests",
    "goodput_requests",
    "goodput_pct",
    "gpu_hours",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "p50_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "scaling_actions",
    "direction_flips",
    "mode",
    "static",
    "startup_time_s",
    "sla_ttft_ms",
    "sla_itl_ms",
    "duration_s",
    "planner_wall_s",
    "simulator_wall_s",
}


def _num(value: Any, spec: str) -> str:
    """Format a number, or an em dash for a missing / non-numeric / NaN value (a report must not crash)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return "\u2014"
    if math.isinf(value):
        return "\u221e" if value > 0 else "-\u221e"
    if spec.endswith("d") and isinstance(value, float):
        value = round(value)  # a count that came through as a float (e.g. 12.0)
    return format(value, spec)


def _goodput_pct(summary: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> float | None:
    """The run's goodput in percent: the harness's figure, else recomputed from the requests."""
    value = summary.get("goodput_pct")
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    if requests:
        return 100.0 * sum(1 for r in requests if r.get("ok")) / len(requests)
    return None


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _row(label: str, value: str, cls: str = "") -> str:
    klass = f"n {cls}".strip()
    return f"<tr><th>{_e(label)}</th><td class='{klass}'>{value}</td></tr>"


def _latency_row(name: str, summary: Mapping[str, Any], key: str, bound: Any) -> str:
    """p50/p90/p99 in one row, a percentile above the SLA bound in red (where the miss is)."""
    cells = []
    for p in ("p50", "p90", "p99"):
        v = summary.get(f"{p}_{key}_ms")
        over = isinstance(v, int | float) and isinstance(bound, int | float) and v > bound
        cells.append(f"<td class='n{' bad' if over else ''}'>{_num(v, ',.1f')}</td>")
    return f"<tr><th>{_e(name)}</th>{''.join(cells)}<td class='n'>{_num(bound, ',.0f')}</td></tr>"


def _mode_text(summary: Mapping[str, Any]) -> str:
    mode = str(summary.get("mode") or "unknown")
    static = summary.get("static")
    if mode == "static" and isinstance(static, list | tuple) and len(static) == 2:
        return f"static, {static[0]} prefill + {static[1]} decode"
    return mode


def _actions_table(actions: Sequence[Mapping[str, Any]]) -> str:
    if not actions:
        return "<p class='muted'>no scaling actions</p>"
    rows = []
    for a in sorted(actions, key=lambda a: float(a.get("t_s") or 0.0)):
        frm, to = a.get("from"), a.get("to")
        arrow = ""
        if isinstance(frm, int | float) and isinstance(to, int | float):
            arrow = " \u2191" if to > frm else " \u2193" if to < frm else ""
        pool = str(a.get("pool", ""))
        colour = COLOURS.get(pool, "#555")
        rows.append(
            f"<tr><td class='n'>{_num(a.get('t_s'), ',.1f')}</td>"
            f"<td style='color:{colour}'>{_e(pool)}</td>"
            f"<td class='n'>{_e(frm)} \u2192 {_e(to)}{arrow}</td><td>{_e(a.get('reason', ''))}</td></tr>"
        )
    head = "<tr><th>t (s)</th><th>pool</th><th>from \u2192 to</th><th>reason</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def render_html(result: Mapping[str, Any], png: bytes) -> str:
    """The report page around an already-rendered chart; every value from the result is escaped."""
    s: Mapping[str, Any] = result.get("summary") or {}
    requests: Sequence[Mapping[str, Any]] = result.get("requests") or []
    actions: Sequence[Mapping[str, Any]] = result.get("actions") or []
    mode = _mode_text(s)
    goodput = _goodput_pct(s, requests)

    facts = " \u00b7 ".join(
        [
            f"mode: <b>{_e(mode)}</b>",
            f"duration {_num(s.get('duration_s'), ',.0f')} s",
            f"SLA: TTFT \u2264 {_num(s.get('sla_ttft_ms'), ',.0f')} ms, "
            f"ITL \u2264 {_num(s.get('sla_itl_ms'), ',.0f')} ms",
            f"worker startup {_num(s.get('startup_time_s'), ',.0f')} s",
            f"{_num(s.get('requests'), ',d')} requests ({_num(s.get('completed_requests'), ',d')} completed)",
        ]
    )
    pw, sw = s.get("planner_wall_s"), s.get("simulator_wall_s")
    share = ""
    if isinstance(pw, int | float) and isinstance(sw, int | float) and pw + sw > 0:
        share = f" ({100.0 * pw / (pw + sw):.1f} % of the wall time in the planner)"
    gp_text = "\u2014" if goodput is None else f"{goodput:.1f} %"
    overview = "".join(
        [
            _row(
                "goodput (met both SLA bounds)",
                f"{gp_text} <span class='muted'>({_num(s.get('goodput_requests'), ',d')} of "
                f"{_num(s.get('requests'), ',d')})</span>",
            ),
            _row("GPU-hours", _num(s.get("gpu_hours"), ",.2f")),
            _row("scaling actions", _num(s.get("scaling_actions", len(actions)), ",d")),
            _row("direction flips", _num(s.get("direction_flips"), ",d")),
            _row("planner wall time (s)", _num(pw, ",.2f") + share),
            _row("simulator wall time (s)", _num(sw, ",.2f")),
        ]
    )
    latency = (
        "<table><tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>SLA bound</th></tr>"
        + _latency_row("TTFT (ms)", s, "ttft", s.get("sla_ttft_ms"))
        + _latency_row("ITL (ms)", s, "itl", s.get("sla_itl_ms"))
        + "</table>"
    )
    extra = [k for k in sorted(s) if k not in _SHOWN]
    extra_html = ""
    if extra:
        rows = "".join(
            f"<tr><th>{_e(k)}</th><td>{_e(json.dumps(s[k], default=str))}</td></tr>" for k in extra
        )
        extra_html = f"<details><summary>other summary fields</summary><table>{rows}</table></details>"
    img = base64.b64encode(png).decode("ascii")
    alt = "Timeline: replicas, queued prefill tokens, queued decode KV tokens, SLA attainment"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Planner simulation report ({_e(mode)})</title>
<style>{CSS}</style></head><body>
<h1>Planner simulation report</h1>
<p class="facts">{facts}</p>
<h2>Summary</h2>
<table>{overview}</table>
{latency}
{extra_html}
<h2>Timeline</h2>
<p class="muted">Vertical lines: scaling actions (blue prefill, orange decode; solid up, dotted down).
Attainment bins requests by arrival time.</p>
<img alt="{_e(alt)}" src="data:image/png;base64,{img}">
<h2>Scaling actions</h2>
{_actions_table(actions)}
</body></html>
"""
