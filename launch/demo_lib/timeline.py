"""The report's figure: every panel on one shared time axis (seconds since the load began), with matplotlib.

Panels: replicas per pool (the planner's desired count, the replicas registered, those scheduling work,
and the connector's starting and standby workers), queues per engine, decode tokens per second per engine,
decode KV, TTFT and ITL per request. The load phases are shaded and every scaling action is a vertical line
on every panel, labelled with its reason on the top one.
"""

from __future__ import annotations

import bisect
import io
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.planner.decision_log import DecisionEntry
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

from .load import RequestResult
from .signals import ConnectorEvent, FpmSample

BAND_COLORS = {"warmup": "#f0f0f0", "burst": "#fde3e3", "idle": "#e8f4e8", "settle": "#f5f5f5"}
POOL_COLORS = {"decode": "#d62728", "prefill": "#1f77b4"}
# A worker counts as registered while its FPM records (heartbeats included) arrived this recently, and as
# scheduling work while a record with scheduled requests did.
REGISTERED_WINDOW_S = 2.5
WORKING_WINDOW_S = 5.0


@dataclass
class Timeline:
    t0: float
    end: float
    samples: list[FpmSample]
    decisions: list[DecisionEntry]
    results: list[RequestResult]
    phase_times: list[tuple[str, float, float]]
    minimum: dict[str, int]
    events: list[ConnectorEvent] = field(default_factory=list)
    pools: tuple[str, ...] = ("prefill", "decode")
    added_worker: str | None = None  # the replica the planner added (marked in the legends)


def short(worker: str) -> str:
    return worker if len(worker) <= 8 else "…" + worker[-6:]


def _name(tl: Timeline, s: FpmSample) -> str:
    name = f"{s.pool} {short(s.worker)}" + (f"/{s.dp_rank}" if s.dp_rank else "")
    return name + (" (added)" if s.worker == tl.added_worker else "")


def desired_steps(tl: Timeline, pool: str) -> tuple[list[float], list[float]]:
    xs, ys = [0.0], [float(tl.minimum.get(pool, 1))]
    for d in sorted(tl.decisions, key=lambda d: d.ts):
        if d.pool == pool and d.is_action:
            xs.append(d.ts - tl.t0)
            ys.append(float(d.desired))
    xs.append(tl.end - tl.t0)
    ys.append(ys[-1])
    return xs, ys


def connector_steps(tl: Timeline, pool: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [0.0], [0.0]
    for e in tl.events:  # the connector's own order; a state change is drawn when the worker made it
        if pool in e.counts and e.happened <= tl.end:
            xs.append(max(0.0, xs[-1], e.happened - tl.t0))
            ys.append(float(e.counts[pool].get(key, 0)))
    if len(xs) > 1:  # the state before the load began is the last one before t0
        before = [y for x, y in zip(xs[1:], ys[1:], strict=True) if x <= 0.0]
        ys[0] = before[-1] if before else 0.0
    xs.append(tl.end - tl.t0)
    ys.append(ys[-1])
    return xs, ys


def replica_counts(
    tl: Timeline, pool: str, width_s: float = 1.0
) -> tuple[list[float], list[float], list[float]]:
    """Per time step: replicas registered (publishing FPM) and replicas scheduling work."""
    seen: dict[str, list[float]] = defaultdict(list)
    working: dict[str, list[float]] = defaultdict(list)
    for s in tl.samples:
        if s.pool != pool:
            continue
        seen[s.worker].append(s.t - tl.t0)
        if s.scheduled_decode_requests > 0 or s.scheduled_prefill_tokens > 0:
            working[s.worker].append(s.t - tl.t0)
    steps = int((tl.end - tl.t0) / width_s) + 1
    xs = [i * width_s for i in range(steps)]

    def count(times: dict[str, list[float]], window: float) -> list[float]:
        per_worker = [sorted(ts) for ts in times.values()]
        return [float(sum(1 for ts in per_worker if _near(ts, x - window, x))) for x in xs]

    return xs, count(seen, REGISTERED_WINDOW_S), count(working, WORKING_WINDOW_S)


def _near(ts: list[float], lo: float, hi: float) -> list[float]:
    """The sorted times in (lo, hi]."""
    i = bisect.bisect_right(ts, lo)
    j = bisect.bisect_right(ts, hi)
    return ts[i:j]


def per_engine(
    tl: Timeline,
    pool: str,
    value: Callable[[FpmSample], float | None],
    width_s: float = 1.0,
    agg: str = "max",
) -> dict[str, tuple[list[float], list[float]]]:
    """Per engine, one value per time bucket: the max (a queue) or the sum (tokens) of its records."""
    buckets: dict[str, dict[int, float]] = defaultdict(dict)
    for s in tl.samples:
        if s.pool != pool:
            continue
        v = value(s)
        if v is None:
            continue
        b = int((s.t - tl.t0) // width_s)
        cur = buckets[_name(tl, s)].get(b)
        if agg == "sum":
            buckets[_name(tl, s)][b] = (cur or 0.0) + v
        else:
            buckets[_name(tl, s)][b] = v if cur is None else max(cur, v)
    out = {}
    for name, bs in sorted(buckets.items()):
        keys = sorted(bs)
        out[name] = ([k * width_s for k in keys], [bs[k] / (width_s if agg == "sum" else 1.0) for k in keys])
    return out


def pool_sum(
    tl: Timeline, pool: str, value: Callable[[FpmSample], float | None]
) -> tuple[list[float], list[float]]:
    total: dict[float, float] = defaultdict(float)
    for xs, ys in per_engine(tl, pool, value).values():
        for x, y in zip(xs, ys, strict=True):
            total[x] += y
    keys = sorted(total)
    return keys, [total[k] for k in keys]


def _decorate(ax: Axes, tl: Timeline, *, label_actions: bool = False) -> None:
    for name, s, e in tl.phase_times:
        ax.axvspan(s - tl.t0, e - tl.t0, color=BAND_COLORS.get(name, "#f5f5f5"), zorder=0, lw=0)
    for d in tl.decisions:
        if d.is_action:
            ax.axvline(d.ts - tl.t0, color=POOL_COLORS.get(d.pool, "#444"), ls="--", lw=1.0, zorder=1)
    if label_actions:
        top = ax.get_ylim()[1]
        for name, s, _ in tl.phase_times:
            ax.text(s - tl.t0 + 1, top * 0.97, name, fontsize=7, va="top", color="#777")
        span = max(1.0, tl.end - tl.t0)
        for i, d in enumerate(a for a in tl.decisions if a.is_action):
            reason = d.reason if len(d.reason) <= 70 else d.reason[:67] + "..."
            left = (d.ts - tl.t0) > 0.6 * span  # late actions are labelled leftwards, inside the panel
            ax.annotate(
                f"{d.pool} {d.current}→{d.desired}: {reason}",
                xy=(d.ts - tl.t0, top * (0.85 - 0.13 * (i % 4))),
                fontsize=6.5,
                color=POOL_COLORS.get(d.pool, "#444"),
                xytext=(-3 if left else 3, 0),
                ha="right" if left else "left",
                textcoords="offset points",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
            )
    ax.grid(True, lw=0.3, alpha=0.6)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), framealpha=0.85)


def _replica_panel(ax: Axes, tl: Timeline, pool: str) -> None:
    xs, ys = desired_steps(tl, pool)
    ax.step(xs, ys, where="post", color="#222", lw=1.6, label="desired (planner)")
    rx, registered, working = replica_counts(tl, pool)
    ax.step(rx, registered, where="post", color=POOL_COLORS[pool], lw=1.0, alpha=0.5, label="registered")
    ax.step(rx, working, where="post", color=POOL_COLORS[pool], lw=2.2, label="serving (scheduling work)")
    if any(pool in e.counts for e in tl.events):  # areas: visible where they overlap the lines
        sx, sy = connector_steps(tl, pool, "starting")
        ax.fill_between(sx, sy, step="post", color="#ff7f0e", alpha=0.35, lw=0, label="starting")
        wx, wy = connector_steps(tl, pool, "standby")
        ax.fill_between(wx, wy, step="post", color="#2ca02c", alpha=0.25, lw=0, label="standby (warm)")
    peak = max([*ys, *registered, 1.0])
    ax.set_ylim(-0.1, peak + 1.6)
    ax.set_ylabel(f"{pool}\nreplicas")


def _series_panel(ax: Axes, series: dict[str, tuple[list[float], list[float]]], ylabel: str) -> None:
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, lw=1.1, label=name)
    if not series:
        ax.plot([], [], label="(no records)")
    ax.set_ylabel(ylabel)


def render(tl: Timeline) -> bytes:
    """The figure as PNG bytes."""
    panels: list[tuple[str, float]] = [(f"replicas:{p}", 1.6) for p in tl.pools if p in ("decode", "prefill")]
    if "prefill" in tl.pools:
        panels.append(("prefill_queue", 1.0))
    panels += [("decode_queue", 1.0), ("decode_tokens", 1.2), ("decode_kv", 1.0), ("ttft", 1.0), ("itl", 1.0)]
    fig = Figure(figsize=(13, 1.75 * sum(h for _, h in panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, gridspec_kw={"height_ratios": [h for _, h in panels]})
    ok = sorted((r for r in tl.results if r.ok), key=lambda r: r.start)
    for ax, (kind, _) in zip(axes, panels, strict=True):
        if kind.startswith("replicas:"):
            _replica_panel(ax, tl, kind.split(":")[1])
        elif kind == "prefill_queue":
            _series_panel(
                ax, per_engine(tl, "prefill", lambda s: s.queued_prefill_tokens), "queued prefill\ntokens"
            )
        elif kind == "decode_queue":
            _series_panel(
                ax, per_engine(tl, "decode", lambda s: s.queued_decode_requests), "queued decode\nrequests"
            )
        elif kind == "decode_tokens":
            tokens = per_engine(tl, "decode", lambda s: s.scheduled_decode_requests, width_s=2.0, agg="sum")
            _series_panel(ax, tokens, "decode tokens/s\nper engine")
        elif kind == "decode_kv":
            kv = {
                "running": pool_sum(tl, "decode", lambda s: s.scheduled_decode_kv_tokens),
                "queued (all)": pool_sum(tl, "decode", lambda s: s.queued_decode_kv_tokens),
                "queued: KV in transfer": pool_sum(tl, "decode", lambda s: s.kv_transfer_tokens),
                "queued: KV ready": pool_sum(tl, "decode", lambda s: s.kv_ready_tokens),
            }
            _series_panel(ax, kv, "decode KV\ntokens")
        elif kind == "ttft":
            ax.scatter(
                [r.start - tl.t0 for r in ok], [r.ttft_s or 0.0 for r in ok], s=6, label="TTFT per request"
            )
            ax.set_ylabel("TTFT (s)")
        elif kind == "itl":
            pts = [(r.start - tl.t0, 1000 * sum(r.itl_s) / len(r.itl_s)) for r in ok if r.itl_s]
            ax.scatter(
                [x for x, _ in pts], [y for _, y in pts], s=6, color="#9467bd", label="mean ITL per request"
            )
            ax.set_ylabel("ITL (ms)")
        _decorate(ax, tl, label_actions=kind == panels[0][0])
    axes[-1].set_xlabel("seconds since the load began")
    axes[-1].set_xlim(0, tl.end - tl.t0)
    axes[0].set_title("What happened: replicas, queues, work and latency on one time axis", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
