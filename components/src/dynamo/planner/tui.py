"""A live one-screen summary for a terminal: pools, replicas, load, the last reason, record counts."""

from __future__ import annotations

from .connector_base import ConnectorStatus
from .observations import BookStats
from .policy import POOLS, Decision

CLEAR = "\x1b[H\x1b[2J"


def render(
    d: Decision, status: ConnectorStatus, stats: BookStats, *, connector: str, tick: int, width: int = 110
) -> str:
    rows = [
        f"dynamo planner  tick {tick}  connector {connector}  {'settled' if status.settled else 'busy'} "
        f"{status.detail}",
        "",
        f"{'pool':8} {'now':>4} {'want':>4} {'workers':>7} {'engines':>7} {'max load':>8}  action",
    ]
    for p in POOLS:
        pd = d.pool(p)
        mx = "-" if pd.load_max is None else f"{pd.load_max:.2f}"
        rows.append(
            f"{p:8} {pd.current:>4} {pd.desired:>4} {pd.workers:>7} {pd.engines:>7} {mx:>8}  {pd.action}"
        )
    rows.append("")
    for p in POOLS:
        rows.append(f"{p}: {d.pool(p).reason}"[:width])
    rejected = sum(stats.rejected.values())
    rows += [
        "",
        f"records {stats.accepted}  heartbeats {stats.heartbeats}  rejected {rejected}  "
        f"restarts {stats.restarts}  gaps {stats.gaps}  dropped stale {stats.dropped_stale}",
    ]
    return "\n".join(rows)
