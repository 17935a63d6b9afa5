"""Run the planner's own loop (book, policy, decision log) on Dynamo's fleet simulator.

The simulator (``dynamo._core.run_mocker_trace_replay``, virtual clock) calls :class:`PlannerPolicy`
through its ``scaling_policy`` hook. Each tick's snapshot becomes FPM records fed to
``Planner.on_record`` and a connector status, ``Planner.tick()`` decides and acts through the
:class:`~.connector.SimulatorConnector`, and the targets go back to the simulator. ``--static`` runs
the same traces on a fixed fleet with no planner.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.fpm_tracker import TrackedWorker, WorkerKey

from ..config import PlannerConfig
from ..decision_log import DecisionLog
from ..loop import Planner
from .connector import POOLS, SimCardSource, SimulatorConnector, engine_capacity
from .inputs import check_trace, engine_args, merge_traces, quiet_simulator_logs
from .prefixes import BLOCK_TOKENS
from .records import queue_snapshot, to_record
from .stats import direction_flips, percentile
from .traffic import SimArrivals, arrivals_from


@dataclass(frozen=True)
class SimSpec:
    """One simulated run: traces, normalized engine args per pool, SLA bounds and the fleet."""

    traces: tuple[str, ...]
    prefill_engine_args: Mapping[str, Any]
    decode_engine_args: Mapping[str, Any]
    sla_ttft_ms: float
    sla_itl_ms: float
    initial: tuple[int, int] = (1, 1)
    static: tuple[int, int] | None = None
    trace_duration_s: float = 0.0
    router: str = "round-robin"  # or "kv": Dynamo's KV-aware router (ROUTERS)
    # Prompt tokens per hash id in the traces: 64 in every trace this package writes (``prefixes``); the
    # simulator's own default is Mooncake's 512, which would count a shared id as 512 cached tokens.
    trace_block_size: int = BLOCK_TOKENS

    @property
    def startup_time_s(self) -> float:
        return float(self.decode_engine_args.get("startup_time") or 0.0)


def trace_spec(
    trace: str | Path,
    initial: tuple[int, int] = (1, 1),
    startup_s: float = 0.0,
    sla_ttft_ms: float = 2000.0,
    sla_itl_ms: float = 50.0,
    router: str = "round-robin",
) -> SimSpec:
    """One trace on the default engine pair (``engine_args`` without overrides) at a cold start."""
    return at_startup(
        SimSpec(
            traces=(str(trace),),
            prefill_engine_args={},
            decode_engine_args={},
            sla_ttft_ms=sla_ttft_ms,
            sla_itl_ms=sla_itl_ms,
            trace_duration_s=check_trace(str(trace)),
            initial=initial,
            router=router,
        ),
        startup_s,
    )


def at_startup(spec: SimSpec, startup_s: float) -> SimSpec:
    """The same run with both pools' engines at another cold start (default engine pair)."""
    return replace(
        spec,
        prefill_engine_args=engine_args({}, "prefill", startup_s),
        decode_engine_args=engine_args({}, "decode", startup_s),
    )


# ``--router`` -> the simulator's ``router_mode``.
ROUTERS = {"round-robin": "round_robin", "kv": "kv_router"}


@dataclass
class _Run:
    ticks: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    planner_wall_s: float = 0.0


class PlannerPolicy:
    """The simulator's scaling-policy hook around one :class:`~dynamo.planner.loop.Planner`."""

    def __init__(
        self,
        cfg: PlannerConfig,
        spec: SimSpec,
        *,
        decision_log: str | None = None,
        progress: Callable[[float, Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.connector = SimulatorConnector()
        self.now = 0.0
        cards = {
            "prefill": SimCardSource(self.connector, "prefill", engine_capacity(spec.prefill_engine_args)),
            "decode": SimCardSource(self.connector, "decode", engine_capacity(spec.decode_engine_args)),
        }
        self.log = DecisionLog(decision_log) if decision_log else None
        self.arrivals = SimArrivals()
        self.planner = Planner(
            cfg,
            self.connector,
            clock=self._clock,
            wall=self._clock,
            log=self.log,
            cards=cards,
            arrivals=self.arrivals,
        )
        self.loop = asyncio.new_event_loop()
        self.run = _Run()
        self.targets = dict(zip(POOLS, spec.initial, strict=True))
        self._counters: dict[tuple[str, str], int] = {}
        self._last: dict[tuple[str, str], ForwardPassMetrics] = {}
        self._components = {"prefill": cfg.prefill_component, "decode": cfg.decode_component}
        self._progress = progress

    def _clock(self) -> float:
        return self.now

    def initial_tick_ms(self) -> float:
        # As live: the first decision comes one interval after the start.
        return self.cfg.interval_s * 1000.0

    def on_tick(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.now = float(snapshot["now_ms"]) / 1000.0
        self.connector.snapshot = snapshot
        self.arrivals.latest = arrivals_from(snapshot.get("traffic"))
        queued = self._feed(snapshot)
        decision = self.loop.run_until_complete(self.planner.tick())
        sent = self.connector.take_targets()
        row: dict[str, Any] = {"t_s": round(self.now, 3)}
        for pool in POOLS:
            active, starting, draining = self.connector.counts(pool)
            target = sent[pool]
            if target is not None and target != self.targets[pool]:
                self.run.actions.append(
                    {
                        "t_s": round(self.now, 3),
                        "pool": pool,
                        "from": self.targets[pool],
                        "to": target,
                        "reason": decision.pool(pool).reason,
                    }
                )
                self.targets[pool] = target
            sig = decision.pool(pool).signals
            row[pool] = {
                "active": active,
                "starting": starting,
                "draining": draining,
                "desired": self.targets[pool],
                "queued_prefill_tokens": queued[pool][0],
                "queued_decode_kv_tokens": queued[pool][1],
                # The startup the policy sizes for; None until it has timed a scale-up to its first record.
                "startup_s": sig.lead_s if sig.startup_measured else None,
            }
        self.run.ticks.append(row)
        self.run.planner_wall_s += time.perf_counter() - t0
        if self._progress is not None:
            self._progress(self.now, row)
        return {
            "target_prefill": sent["prefill"],
            "target_decode": sent["decode"],
            "next_tick_ms": float(snapshot["now_ms"]) + self.cfg.interval_s * 1000.0,
        }

    def _feed(self, snapshot: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """Every active engine's snapshot -> a record through ``Planner.on_record``; returns queued totals.

        The simulator lists only engines that ran a pass since the last tick; a live worker publishes
        a queue snapshot instead (wall_time 0, its queue as it stands; an idle heartbeat when empty), so
        an active engine without a pass gets one with its last queue. The mocker (1.6.1) also sends an
        all-zero snapshot for an engine that holds a queue but ran no pass (seen for a prefill engine
        with 1.5M queued tokens); that counts as no pass too. Draining engines are left out, as
        discovery no longer lists a draining worker.
        """
        out: dict[str, tuple[int, int]] = {}
        endpoint = self.cfg.endpoint
        for pool in POOLS:
            q_prefill = q_decode = 0
            component = self._components[pool]
            by_id = {snap["worker_id"]: snap for snap in snapshot.get(f"{pool}_fpm_snapshots", ())}
            for wid in snapshot.get(f"active_{pool}_ids", ()):
                ckey = (pool, str(wid))
                n = self._counters.get(ckey, 0) + 1
                self._counters[ckey] = n
                snap = by_id.get(wid)
                if snap is not None and not _empty(snap):
                    record = to_record(snap, n)
                    self._last[ckey] = record
                else:
                    record = queue_snapshot(self._last.get(ckey), wid, n)
                key = WorkerKey(component, endpoint, record.worker_id, record.dp_rank)
                worker = TrackedWorker(key, record, self.now, int(self.now * 1000), None, records=n)
                self.planner.on_record(worker)
                q_prefill += record.queued_requests.sum_prefill_tokens
                q_decode += record.queued_requests.sum_decode_kv_tokens
            out[pool] = (q_prefill, q_decode)
        return out

    def close(self) -> None:
        self.loop.close()
        if self.log is not None:
            self.log.close()


Script = Callable[[float], tuple[int, int]]


class ScriptedPolicy:
    """A fleet that follows a schedule (seconds -> prefill, decode targets): the frontier baselines.

    No planner: the targets are written in advance (e.g. from each phase's measured need), so the
    outcome shows what any policy that reaches those sizes at those times would get, cold starts and all.
    """

    def __init__(self, script: Script, spec: SimSpec, interval_s: float) -> None:
        self.script = script
        self.interval_s = interval_s
        self.targets = dict(zip(POOLS, spec.initial, strict=True))
        self.run = _Run()

    def initial_tick_ms(self) -> float:
        return self.interval_s * 1000.0

    def on_tick(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        now = float(snapshot["now_ms"]) / 1000.0
        wanted = dict(zip(POOLS, self.script(now), strict=True))
        out: dict[str, Any] = {"next_tick_ms": float(snapshot["now_ms"]) + self.interval_s * 1000.0}
        row: dict[str, Any] = {"t_s": round(now, 3)}
        for pool in POOLS:
            target = max(int(wanted[pool]), 1)
            send = None
            if target != self.targets[pool]:
                self.run.actions.append(
                    {"t_s": round(now, 3), "pool": pool, "from": self.targets[pool], "to": target}
                )
                self.targets[pool] = send = target
            out[f"target_{pool}"] = send
            active = len(snapshot.get(f"active_{pool}_ids", ()))
            starting = len(snapshot.get(f"starting_{pool}_ids", ()))
            draining = len(snapshot.get(f"draining_{pool}_ids", ()))
            row[pool] = {"active": active, "starting": starting, "draining": draining, "desired": target}
        self.run.ticks.append(row)
        return out


def _empty(snap: Mapping[str, Any]) -> bool:
    """A snapshot with no pass time and nothing scheduled or queued (the mocker's "no pass")."""
    return not snap.get("wall_time") and not any(
        snap.get(k)
        for k in ("num_prefill_requests", "num_decode_requests", "num_queued_prefill", "num_queued_decode")
    )


def _replay(spec: SimSpec, fleet: tuple[int, int], policy: Any, telemetry_ms: float | None) -> Any:
    if len(spec.traces) > 1:
        with tempfile.TemporaryDirectory(prefix="dynamo-simulate-") as tmp:
            merged = merge_traces(list(spec.traces), Path(tmp) / "merged.jsonl")
            return _replay(replace(spec, traces=(str(merged),)), fleet, policy, telemetry_ms)
    quiet_simulator_logs()
    from dynamo._core import run_mocker_trace_replay

    return run_mocker_trace_replay(
        list(spec.traces),
        prefill_engine_args=dict(spec.prefill_engine_args),
        decode_engine_args=dict(spec.decode_engine_args),
        num_prefill_workers=fleet[0],
        num_decode_workers=fleet[1],
        sla_ttft_ms=spec.sla_ttft_ms,
        sla_itl_ms=spec.sla_itl_ms,
        scaling_policy=policy,
        capture_per_request=True,
        capture_telemetry=telemetry_ms is not None,
        telemetry_sample_interval_ms=telemetry_ms or 1000.0,
        trace_format="mooncake",
        trace_block_size=spec.trace_block_size,
        router_mode=ROUTERS[spec.router],
    )


def _static_ticks(result: Any, fleet: tuple[int, int]) -> list[dict[str, Any]]:
    tel = result.telemetry or {"samples": []}
    rows = []
    for s in tel["samples"]:
        row: dict[str, Any] = {"t_s": round(float(s["sampled_at_ms"]) / 1000.0, 3)}
        for i, pool in enumerate(POOLS):
            metrics = s.get(f"{pool}_scheduler_metrics", [])
            row[pool] = {
                "active": len(s.get(f"active_{pool}_ids", [])),
                "starting": len(s.get(f"starting_{pool}_ids", [])),
                "draining": len(s.get(f"draining_{pool}_ids", [])),
                "desired": fleet[i],
                # The simulator's telemetry counts waiting requests, not their tokens.
                "queued_prefill_tokens": None,
                "queued_decode_kv_tokens": None,
                "waiting_requests": sum(int(m.get("waiting_requests", 0)) for m in metrics),
            }
        rows.append(row)
    return rows


def _requests(per_request: Sequence[Mapping[str, Any]] | None, spec: SimSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in per_request or ():
        ttft, itl = r.get("ttft_ms"), r.get("itl_ms")
        ok = ttft is not None and ttft <= spec.sla_ttft_ms and (itl is None or itl <= spec.sla_itl_ms)
        out.append(
            {
                "arrival_s": round(float(r.get("arrival_time_ms") or 0.0) / 1000.0, 3),
                "ttft_ms": ttft,
                "itl_ms": itl,
                "ok": ok,
            }
        )
    out.sort(key=lambda r: float(r["arrival_s"]))
    return out


def measured_startup(ticks: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Per pool, the last startup the planner measured (scale-up to the new replica's first record)."""
    out: dict[str, float | None] = {}
    for p in POOLS:
        seen = [t[p]["startup_s"] for t in ticks if t[p].get("startup_s") is not None]
        out[p] = seen[-1] if seen else None
    return out


def summarize(
    spec: SimSpec,
    sim: Mapping[str, Any],
    requests: Sequence[Mapping[str, Any]],
    actions: Sequence[Mapping[str, Any]],
    ticks: Sequence[Mapping[str, Any]],
    *,
    wall_s: float,
    planner_wall_s: float,
) -> dict[str, Any]:
    """The ``--json`` object: the simulator's outcome and what the planner did to get it."""
    n = int(sim.get("num_requests", 0))
    good = int(sim.get("goodput_completed_requests", 0))
    ttfts = [float(r["ttft_ms"]) for r in requests if r.get("ttft_ms") is not None]
    itls = [float(r["itl_ms"]) for r in requests if r.get("itl_ms") is not None]
    per_pool_actions = {p: sum(1 for a in actions if a["pool"] == p) for p in POOLS}
    flips = {p: direction_flips([(a["from"], a["to"]) for a in actions if a["pool"] == p]) for p in POOLS}
    peak = {p: max((t[p]["active"] + t[p]["starting"] for t in ticks), default=0) for p in POOLS}
    out: dict[str, Any] = {
        "mode": "static" if spec.static is not None else "planner",
        "static": list(spec.static) if spec.static is not None else None,
        "initial": list(spec.static or spec.initial),
        "startup_time_s": spec.startup_time_s,
        "router": spec.router,
        # The share of prompt tokens a prefill found in its engine's prefix cache.
        "prefix_cache_reused_pct": round(100.0 * float(sim.get("prefix_cache_reused_ratio") or 0.0), 2),
        "sla_ttft_ms": spec.sla_ttft_ms,
        "sla_itl_ms": spec.sla_itl_ms,
        "requests": n,
        "completed_requests": int(sim.get("completed_requests", 0)),
        "goodput_requests": good,
        "goodput_pct": round(100.0 * good / n, 2) if n else 0.0,
        "gpu_hours": round(float(sim.get("gpu_hours", 0.0)), 5),
        "prefill_worker_seconds": round(float(sim.get("prefill_worker_seconds", 0.0)), 1),
        "decode_worker_seconds": round(float(sim.get("decode_worker_seconds", 0.0)), 1),
        "duration_s": round(float(sim.get("duration_ms", 0.0)) / 1000.0, 3),
        "scaling_actions": sum(per_pool_actions.values()),
        "direction_flips": sum(flips.values()),
        "actions": per_pool_actions,
        "flips": flips,
        "peak_replicas": peak,
        "measured_startup_s": measured_startup(ticks),
        "planner_ticks": len(ticks) if spec.static is None else 0,
        "planner_wall_s": round(planner_wall_s, 3),
        "simulator_wall_s": round(max(wall_s - planner_wall_s, 0.0), 3),
    }
    for q in (50, 90, 99):
        out[f"p{q}_ttft_ms"] = round(percentile(ttfts, q), 2) if ttfts else None
        out[f"p{q}_itl_ms"] = round(percentile(itls, q), 3) if itls else None
    return out


class Progress:
    """A progress line on stderr every few wall seconds, for runs longer than that."""

    def __init__(self, total_s: float, out: TextIO = sys.stderr, every_s: float = 3.0) -> None:
        self.total_s = total_s
        self.out = out
        self.every_s = every_s
        self.started = time.monotonic()
        self.last = self.started

    def __call__(self, now: float, row: Mapping[str, Any]) -> None:
        t = time.monotonic()
        if t - self.last < self.every_s:
            return
        self.last = t
        pools = ", ".join(
            f"{p} {row[p]['active']}" + (f" (+{row[p]['starting']} starting)" if row[p]["starting"] else "")
            for p in POOLS
        )
        total = f"/{self.total_s:.0f}" if self.total_s else ""
        self.out.write(f"simulate: {now:.0f}{total} s simulated, {pools}; {t - self.started:.1f} s wall\n")
        self.out.flush()


def simulate(
    spec: SimSpec,
    cfg: PlannerConfig | None,
    *,
    decision_log: str | None = None,
    progress: bool = False,
    script: Script | None = None,
) -> dict[str, Any]:
    """One run (planner, ``spec.static``, or a ``script`` of targets over time); returns
    ``{"summary", "ticks", "actions", "requests"}``."""
    t0 = time.perf_counter()
    if script is not None:
        scripted = ScriptedPolicy(script, spec, cfg.interval_s if cfg is not None else 5.0)
        result = _replay(spec, spec.initial, scripted, None)
        run = scripted.run
    elif spec.static is not None:
        fleet = spec.static
        interval = cfg.interval_s if cfg is not None else 5.0
        result = _replay(spec, fleet, None, interval * 1000.0)
        run = _Run(ticks=_static_ticks(result, fleet))
    else:
        if cfg is None:
            raise ValueError("a planner run needs a PlannerConfig")
        # The planner's SLA targets are the simulator's goodput bounds.
        cfg = replace(cfg, sla=replace(cfg.sla, ttft_ms=spec.sla_ttft_ms, itl_ms=spec.sla_itl_ms))
        policy = PlannerPolicy(
            cfg,
            spec,
            decision_log=decision_log,
            progress=Progress(spec.trace_duration_s) if progress else None,
        )
        try:
            result = _replay(spec, spec.initial, policy, None)
        finally:
            policy.close()
        run = policy.run
    wall = time.perf_counter() - t0
    requests = _requests(result.per_request, spec)
    summary = summarize(
        spec,
        result.summary,
        requests,
        run.actions,
        run.ticks,
        wall_s=wall,
        planner_wall_s=run.planner_wall_s,
    )
    if script is not None:
        summary["mode"] = "scripted"
    return {"summary": summary, "ticks": run.ticks, "actions": run.actions, "requests": requests}
