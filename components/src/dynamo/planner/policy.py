"""The scaling policy: a pure function from observations and a small state to a decision with reasons.

No I/O, no clock (``Observation.now`` is passed in), no randomness, so every rule is testable in
microseconds and replayable offline. Per pool, ordered rules (each a named function below, like the
stages of Kubernetes' HPA) draft a decision; then the interval guard and the GPU budget apply to both:

0. ``rule_first_look``: the fleet found at the planner's first decision is recorded as a need, so the
   stabilization holds it (the HPA's initial recommendation).
1. ``rule_in_flight``: replicas asked for and still starting are capacity to come (the pool sizes on
   top of them instead of waiting); a scale-down in flight holds; an action not done after
   ``action_timeout_s`` is given up and the pool asks for what is actually running.
2. ``rule_bounds``: outside [min, max] -> back in (down by at most ``scale_down_step``).
3. ``rule_mismatch``: replicas != publishing workers (beyond those starting): hold for
   ``mismatch_grace_s``, then decide with the silent ones counted as loaded (never a scale-down).
4. ``rule_idle``: no work at all for ``idle_window_s`` -> down towards the minimum.
5. ``rule_load``: proportional sizing. The pool's demand, projected to when a new replica would be
   ready (its trend over ``trend_window_s`` times the measured startup), over what one engine carries
   at the target -> the replicas needed; several may be added at once. Down only when the
   consolidated load fits, for ``scale_down_window_s``, by at most ``scale_down_step``, never while
   the trend says the load comes back within a startup.
6. ``apply_interval_guard`` and ``apply_budget``: at most one action per pool per interval; the GPU
   budget is never exceeded (draining replicas still count); an ask that does not fit is cut to what
   fits, and if nothing fits the other pool gives a replica when its consolidated load allows.

``settle()`` applies the connector's outcome (sent, failed, dry run) to the state, so the loop and the
replay never edit policy state themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, NamedTuple, TypeVar

from .config import PlannerConfig
from .observations import Arrivals, EngineObs, Observation, PoolObs

PoolName = Literal["prefill", "decode"]
POOLS: tuple[PoolName, PoolName] = ("prefill", "decode")
Action = Literal["scale_up", "scale_down", "hold"]
Want = Literal["up", "down", "idle", "steady", "hold"]
SampleValue = TypeVar("SampleValue")  # a windowed sample's value: demand (float) or replicas (int)


def other(pool: PoolName) -> PoolName:
    return "decode" if pool == "prefill" else "prefill"


@dataclass(frozen=True, slots=True)
class InFlight:
    target: int
    previous: int
    since: float


@dataclass(frozen=True, slots=True)
class PoolState:
    down_since: float | None = None
    idle_since: float | None = None
    mismatch_since: float | None = None
    last_action_at: float | None = None
    in_flight: InFlight | None = None
    # (time, demand) samples inside the trend window; demand in the pool's own unit (see Sizing).
    trend: tuple[tuple[float, float], ...] = ()
    # Prefill: tokens/s one saturated engine processes (EWMA of its passes); None until seen.
    engine_rate: float | None = None
    # Seconds from a scale-up to the new replica's first record (EWMA); None until measured.
    startup_s: float | None = None
    # A scale-up whose first new record is awaited: (asked at, replicas running or starting before it).
    startup_probe: tuple[float, int] | None = None
    # (time, replicas the sizing asked for) inside the scale-down stabilization window.
    needs: tuple[tuple[float, int], ...] = ()
    # Decode with ``decode_trend: held``: (time, what the engines hold) samples inside the trend window.
    held_trend: tuple[tuple[float, float], ...] = ()
    # The last scale-up's landing, for ``rule_late_landing``: (landed at, replicas before the ask).
    landed: tuple[float, int] | None = None
    # When the pool's first decision recorded the fleet it found as a need (``rule_first_look``); None before.
    first_look_at: float | None = None
    first_look_replicas: int | None = None  # the replicas it found then
    # Prefill: (engines publishing, engines saturated) at the previous sizing, the fleet the queue's
    # latest change was made on.
    prefill_engines: tuple[int, int] | None = None
    # Decode, with arrivals: (time, requests per second the frontend admitted) inside the trend window,
    # since the arrivals last resumed from none; and (time, requests the engines hold or queue) while
    # every engine has been saturated (``_throughput_bound``).
    arrival_trend: tuple[tuple[float, float], ...] = ()
    saturated_requests: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyState:
    prefill: PoolState = PoolState()
    decode: PoolState = PoolState()

    def pool(self, name: PoolName) -> PoolState:
        return self.prefill if name == "prefill" else self.decode

    def with_pool(self, name: PoolName, st: PoolState) -> PolicyState:
        return replace(self, prefill=st) if name == "prefill" else replace(self, decode=st)


class Summary(NamedTuple):
    """Per-engine values of one pool, summarised for the log."""

    max: float
    mean: float
    n: int


@dataclass(frozen=True, slots=True)
class Signals:
    """What a decision was made from, typed; the decision log writes the fields that are set.

    One flat record for both pools and both targets: the pool-independent counts, the sizing's load and
    demand, then the decode, prefill and SLA model's own figures (None where a rule did not compute one).
    """

    # The pool as observed.
    replicas: int | None = None
    workers: int | None = None
    engines: int | None = None
    capacity_from: dict[str, int] | None = None
    rejected_records: int | None = None
    starting: int | None = None
    mismatch_s: float | None = None
    # The sizing.
    want: Want | None = None
    lead_s: float | None = None  # the startup sized for: measured, or ``expected_startup_s`` until then
    startup_measured: bool | None = None
    loads: Summary | None = None
    up: float | None = None
    down: float | None = None
    target: float | None = None
    consolidated: float | None = None
    needed: int | None = None
    demand: float | None = None
    projected: float | None = None
    slope: float | None = None
    trend_r2: float | None = None
    # Decode.
    decode_kv_tokens: int | None = None
    queued_decode_kv_tokens: int | None = None
    decode_kv_transfer_tokens: int | None = None
    decode_kv_waiting_tokens: int | None = None
    transfer_bound_engines: int | None = None
    slot_load_max: float | None = None
    held_slope: float | None = None  # ``decode_trend: held``: the slope sized for, engines per second
    trend_rise: float | None = None  # the trend's rise over its window, engines
    trend_noise: float | None = None  # ``trend_noise_z`` standard deviations of the requests' wander, engines
    completed_per_s: float | None = None  # requests a saturated decode pool completes per second
    throughput_bound: float | None = None  # ``throughput_cap`` x what the arrivals ahead need, engines
    late_landing_from: int | None = None  # a scale-up from this many landed after its load: needs forgotten
    prefill_rising_to: int | None = None  # a scale-down held: prefill is scaling up to this many replicas
    # Prefill.
    queued_prefill_tokens: int | None = None
    engine_rate_tok_s: float | None = None
    arrival_engines: float | None = None  # engines' worth of work the frontend's arrivals bring
    queue_wait_s: float | None = None
    deficit_engines: float | None = None
    drain_engines: float | None = None
    # The SLA target's latency models.
    ttft_est_s: Summary | None = None
    ttft_target_s: float | None = None
    itl_est_s: Summary | None = None
    itl_target_s: float | None = None
    samples: int | None = None
    kv_over: bool | None = None
    # The GPU budget.
    gpu_budget: int | None = None
    gpus_after: int | None = None

    def merged(self, other: Signals) -> Signals:
        """These signals with every field ``other`` sets."""
        return replace(self, **{k: v for k in _SIGNAL_FIELDS if (v := getattr(other, k)) is not None})

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, as the decision log writes them."""
        out: dict[str, Any] = {}
        for k in _SIGNAL_FIELDS:
            v = getattr(self, k)
            if v is not None:
                out[k] = v._asdict() if isinstance(v, Summary) else v
        return out


_SIGNAL_FIELDS = tuple(f.name for f in fields(Signals))


@dataclass(frozen=True, slots=True)
class Sizing:
    """A pool's load as the policy judged it (the typed signals). ``want`` is before bounds and budget.

    ``demand`` and ``projected`` are in engines' worth of work at 100% (decode: KV or running slots;
    prefill: the arrivals the queue's change shows, see ``_prefill_arrivals``); ``needed`` is the
    replica count the projected demand asks for at the target utilisation.
    """

    want: Want
    why: str
    load_max: float = 0.0
    demand: float | None = None
    projected: float | None = None
    needed: int | None = None
    consolidated: float | None = None
    slope: float | None = None
    signals: Signals = Signals()
    # What the scale-down stabilization holds of ``needed``, when less (prefill: the arrivals' need, not
    # the replicas a backlog's drain asked for on top); None: all of it.
    held_need: int | None = None


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: PoolName
    current: int
    desired: int
    action: Action
    reason: str
    workers: int = 0
    engines: int = 0
    sizing: Sizing | None = None
    signals: Signals = Signals()  # everything above and more, for the log

    @property
    def load_max(self) -> float | None:
        return None if self.sizing is None or self.sizing.want in ("idle", "hold") else self.sizing.load_max


@dataclass(frozen=True, slots=True)
class Decision:
    now: float
    prefill: PoolDecision
    decode: PoolDecision

    def pool(self, name: PoolName) -> PoolDecision:
        return self.prefill if name == "prefill" else self.decode

    @property
    def changed(self) -> bool:
        return self.prefill.desired != self.prefill.current or self.decode.desired != self.decode.current


# --------------------------------------------------------------------------------------------------
# Load per engine.


def engine_idle(e: EngineObs) -> bool:
    r = e.record
    s, q = r.scheduled_requests, r.queued_requests
    return (
        s.num_prefill_requests == 0
        and s.num_decode_requests == 0
        and q.num_prefill_requests == 0
        and q.num_decode_requests == 0
    )


class DecodeDemand(NamedTuple):
    tokens: float  # KV tokens the engine must hold
    requests: float  # requests that need a running slot (max_num_seqs)
    transfer_tokens: int
    waiting_tokens: int  # queued decode KV waiting for a slot (ready or preempted)
    transfer_bound: bool


def decode_demand(e: EngineObs, weight: float, up: float) -> DecodeDemand:
    """Decode work that counts as demand, in KV tokens and in running slots, with the split rule.

    Without the transfer/ready split (upstream records) every queued decode request and token counts,
    as upstream does. With it: requests whose KV arrived (ready) and preempted ones wait for a decode
    slot, so they always count; requests still in transfer count too, unless the engine is
    *transfer-bound* -- nothing waits for a slot and what it holds is at or below the scale-up
    threshold in KV and in slots -- then the transfer backlog is a link problem, not missing decode
    capacity, and counts with ``transfer_bound_weight`` (default 0).
    """
    s, q = e.record.scheduled_requests, e.record.queued_requests
    # An aggregated engine (in the decode pool) also queues prompts: they will need KV and slots.
    prompts_kv, prompts = q.sum_prefill_tokens + s.sum_prefill_tokens, q.num_prefill_requests
    if q.sum_decode_kv_transfer_tokens is None:
        return DecodeDemand(
            float(s.sum_decode_kv_tokens + q.sum_decode_kv_tokens + prompts_kv),
            float(s.num_decode_requests + q.num_decode_requests + prompts + s.num_prefill_requests),
            0,
            q.sum_decode_kv_tokens,
            False,
        )
    kv = e.capacity.kv_tokens or 1
    seqs = e.capacity.max_num_seqs
    transfer = q.sum_decode_kv_transfer_tokens
    transfer_reqs = q.num_decode_kv_transfer_requests or 0
    waiting = max(q.sum_decode_kv_tokens - transfer, 0)
    waiting_reqs = q.num_decode_requests - transfer_reqs
    held = s.sum_decode_kv_tokens + waiting + prompts_kv
    held_reqs = s.num_decode_requests + max(waiting_reqs, 0) + prompts + s.num_prefill_requests
    bound = transfer > 0 and waiting_reqs <= 0 and held / kv <= up and (not seqs or held_reqs / seqs <= up)
    if bound:
        return DecodeDemand(
            held + weight * transfer, held_reqs + weight * transfer_reqs, transfer, waiting, True
        )
    return DecodeDemand(float(held + transfer), float(held_reqs + transfer_reqs), transfer, waiting, False)


def decode_load(e: EngineObs, dd: DecodeDemand) -> float:
    """KV demand / KV capacity, or running-slot demand / ``max_num_seqs`` when known: the higher."""
    kv = e.capacity.kv_tokens or 1
    load = dd.tokens / kv
    seqs = e.capacity.max_num_seqs
    if seqs:
        load = max(load, dd.requests / seqs)
    return load


def trend_fit(samples: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(slope per second, r squared) of a least-squares line through (time, demand) samples."""
    pts = list(samples)
    n = len(pts)
    if n < 2:
        return 0.0, 0.0
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    var_t = sum((t - mt) ** 2 for t, _ in pts)
    var_v = sum((v - mv) ** 2 for _, v in pts)
    if var_t <= 0:
        return 0.0, 0.0
    cov = sum((t - mt) * (v - mv) for t, v in pts)
    r2 = cov * cov / (var_t * var_v) if var_v > 0 else 0.0
    return cov / var_t, r2


def trend_slope(samples: Iterable[tuple[float, float]]) -> float:
    """Least-squares slope (demand units per second) of (time, demand) samples; 0 with < 2 samples."""
    return trend_fit(samples)[0]


def _summ(values: list[float]) -> Summary:
    return Summary(round(max(values), 4), round(sum(values) / len(values), 4), len(values))


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the load rules need besides the observation: the state and the pool's lead time."""

    pool: PoolObs
    state: PoolState
    cfg: PlannerConfig
    replicas: int  # capacity counted: running + asked-for replicas still starting
    lead_s: float  # how long until a replica asked for now would serve
    starting: int = 0  # of ``replicas``, still starting (not publishing yet, not silent)
    arrivals: Arrivals | None = None  # the frontend's arrival rate, when a source is configured


def _per_worker(pool: PoolObs) -> float:
    return len(pool.engines) / max(pool.workers, 1)


def _consolidated(loads: list[float], pool: PoolObs, up: float) -> tuple[float, float, float]:
    """(load spread over the engines left after removing one replica, silent engines, engines left)."""
    n = len(loads)
    per_worker = _per_worker(pool)
    expected = max(float(n), per_worker * pool.replicas)
    silent = expected - n
    remaining = expected - per_worker
    value = (sum(loads) + silent * up) / remaining if remaining > 0 else math.inf
    return value, silent, remaining


def _needed_replicas(engines_needed: float, pool: PoolObs) -> int:
    """Engines' worth of work -> whole replicas (a replica brings all its dp ranks)."""
    return max(1, math.ceil(engines_needed / _per_worker(pool) - 1e-9))


def _within(
    samples: tuple[tuple[float, SampleValue], ...], window: float, now: float, value: SampleValue
) -> tuple[tuple[float, SampleValue], ...]:
    """The (time, value) samples at most ``window`` seconds old, with ``(now, value)`` appended."""
    return (*(x for x in samples if now - x[0] <= window), (now, value))


def _trend(view: PoolView, value: float, now: float) -> tuple[tuple[float, float], ...]:
    """The pool's (time, value) samples inside ``trend_window_s``, with today's appended."""
    return _within(view.state.trend, view.cfg.trend_window_s, now, value)


def _capacity_unknown(pool: PoolObs, field: str) -> Sizing | None:
    """Hold, naming the first engine whose capacity does not say ``field`` (no guessing at load)."""
    missing = next((e.worker_id for e in pool.engines if not getattr(e.capacity, field)), None)
    return None if missing is None else Sizing("hold", f"capacity unknown ({field}) for worker {missing}")


def decode_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := _capacity_unknown(pool, "kv_tokens")) is not None:
        return unknown, view.state
    up, down, target = th.decode_up, th.decode_down, th.decode_target
    loads: list[float] = []
    transfer = waiting = bound = 0
    slot_max = 0.0
    # The pool's demand: what the engines hold, plus their queues counted up to ``decode_queue_weight``
    # times what they hold. A queue behind full slots says the pool is short, not by how much: the
    # backlog stays with its engine (it drains there), so counted in full it sizes the fleet for a moment.
    cap = cfg.decode_queue_weight
    demand = held_total = requests = 0.0
    for e in pool.engines:
        dd = decode_demand(e, cfg.transfer_bound_weight, up)
        load = decode_load(e, dd)
        loads.append(load)
        requests += dd.requests
        transfer += dd.transfer_tokens
        waiting += dd.waiting_tokens
        bound += dd.transfer_bound
        seqs = e.capacity.max_num_seqs
        s = e.record.scheduled_requests
        held = s.sum_decode_kv_tokens / (e.capacity.kv_tokens or 1)
        if seqs:
            slot_max = max(slot_max, dd.requests / seqs)
            held = max(held, s.num_decode_requests / seqs)
        demand += held + min(max(load - held, 0.0), cap * max(held, 1.0))
        held_total += held
    sig = Signals(
        decode_kv_tokens=sum(e.record.scheduled_requests.sum_decode_kv_tokens for e in pool.engines),
        queued_decode_kv_tokens=sum(e.record.queued_requests.sum_decode_kv_tokens for e in pool.engines),
        decode_kv_transfer_tokens=transfer,
        decode_kv_waiting_tokens=waiting,
        transfer_bound_engines=bound,
        slot_load_max=round(slot_max, 4),
    )
    samples = _trend(view, demand, now)
    st = replace(view.state, trend=samples)
    slope, r2 = trend_fit(samples)
    growth = slope
    if cfg.decode_trend == "held":
        held_samples = _within(view.state.held_trend, cfg.trend_window_s, now, held_total)
        st = replace(st, held_trend=held_samples)
        growth = trend_slope(held_samples)
        sig = replace(sig, held_slope=round(growth, 6))
    # A trend is a guess: never project more than ``projection_cap`` times today's demand on top of it.
    projected = demand + min(max(growth, 0.0) * view.lead_s, cfg.projection_cap * max(demand, 1.0))
    # A consistent rise holds a scale-down from 4 samples; it triggers a scale-up ahead of today's demand
    # (the costly direction) from 6, so that one step after three flat samples does not read as a ramp.
    rising = len(samples) >= 4 and slope > 0 and r2 >= cfg.trend_min_r2
    rise, noise = slope * _span(samples), _trend_noise(view, samples, demand, requests)
    if noise is not None:
        sig = replace(sig, trend_rise=round(rise, 4), trend_noise=round(noise, 4))
    sustained = rising and len(samples) >= 6 and (noise is None or rise >= noise)
    sig = replace(sig, trend_r2=round(r2, 3))
    throughput, st = _throughput_bound(view, st, now, loads, requests)
    if throughput is not None:
        completed, limit = throughput
        sig = replace(sig, completed_per_s=round(completed, 4), throughput_bound=round(limit, 4))
        projected = min(projected, max(limit, demand))
    return _size(view, loads, demand, projected, slope, up, down, target, sig, sustained, rising=rising), st


def _throughput_bound(
    view: PoolView, st: PoolState, now: float, loads: list[float], requests: float
) -> tuple[tuple[float, float] | None, PoolState]:
    """(requests completed per second, the engines' bound on the projection), or None when it cannot be
    told: a saturated decode pool's throughput says how many engines the arrivals expected one startup
    ahead keep busy, whatever its demand's trend reads.

    While every engine is saturated (load >= 1: slots or KV full, a queue behind them), the pool completes
    what arrives less what it piles up: arrivals - the growth of the requests it holds and queues (their
    slope while saturated, from 3 samples). A queue that keeps growing on a short pool reads as a rising
    trend, and a startup's projection of it asks for replicas a burst's steady load never fills
    (docs/planner-evaluation.md, "Measured in session 19"). The arrivals ahead are today's plus their own
    consistent rise over the startup (a ramp); a resumption from none starts their window afresh, since a
    step from zero is an onset, not a trend. The bound is ``throughput_cap`` times arrivals ahead over
    each engine's completions.
    """
    arrivals, cfg = view.arrivals, view.cfg
    if arrivals is None or cfg.throughput_cap <= 0 or arrivals.requests_per_s <= 0:
        return None, replace(st, arrival_trend=(), saturated_requests=())
    rate = arrivals.requests_per_s
    admitted = _within(st.arrival_trend, cfg.trend_window_s, now, rate)
    st = replace(st, arrival_trend=admitted)
    if not loads or min(loads) < 1.0:
        return None, replace(st, saturated_requests=())
    held = _within(st.saturated_requests, cfg.trend_window_s, now, requests)
    st = replace(st, saturated_requests=held)
    completed = rate - trend_slope(held)
    if len(held) < 3 or completed <= 0:
        return None, st
    ahead = rate
    slope, r2 = trend_fit(admitted)
    if len(admitted) >= 4 and slope > 0 and r2 >= cfg.trend_min_r2:
        ahead += slope * view.lead_s
    return (completed, cfg.throughput_cap * ahead * len(loads) / completed), st


def _span(samples: tuple[tuple[float, float], ...]) -> float:
    return samples[-1][0] - samples[0][0] if samples else 0.0


def _trend_noise(
    view: PoolView, samples: tuple[tuple[float, float], ...], demand: float, requests: float
) -> float | None:
    """How far the demand may rise over the trend's window by chance: ``trend_noise_z`` standard
    deviations of the requests' wander, in engines; None when it cannot be told (no arrivals) or is off.

    At a steady rate the count of R requests in flight is Poisson and changes over a span t by a
    standard deviation of sqrt(2 R min(t / life, 1)) requests (a request's life = R / arrival rate):
    a 40 s window over requests that live 30 s can rise consistently by chance alone. Demand is about
    proportional to the count.
    """
    arrivals, z = view.arrivals, view.cfg.trend_noise_z
    if z <= 0 or arrivals is None or arrivals.requests_per_s <= 0 or requests < 1 or len(samples) < 2:
        return None
    life = requests / arrivals.requests_per_s
    return z * demand * math.sqrt(2.0 * min(_span(samples) / life, 1.0) / requests)


def arrival_engines(view: PoolView, rate: float | None) -> float | None:
    """Engines' worth of prefill work the frontend's arrivals bring, or None when it cannot be told.

    A pass of n prompt tokens takes ``a + b n`` seconds (the pool's pass-time fit, from every warm
    engine's passes, saturated or not); in a full pass of ``max_num_batched_tokens`` (B) the fixed part
    is shared, so a token costs ``b + a / B`` seconds. Without a fit, a token costs one over the rate
    measured on saturated engines. No source, no fit and no rate: None.
    """
    arrivals = view.arrivals
    if arrivals is None or not view.pool.engines:
        return None
    tokens_s = arrivals.prompt_tokens_per_s
    fit = view.pool.latency
    if fit is not None and fit.samples >= view.cfg.sla.min_samples and len(fit.coef) == 2 and fit.coef[1] > 0:
        a, b = fit.coef
        batch = view.pool.engines[0].capacity.max_num_batched_tokens or max(arrivals.mean_isl, 1.0)
        return tokens_s * (b + max(a, 0.0) / batch)
    if rate is not None and rate > 0:
        return tokens_s / rate
    return None


def prefill_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    """Prefill demand from the queue: the arrivals its latest change shows, in engines.

    A saturated engine (a queue behind its pass) processes ``engine_rate`` tokens/s, measured from its
    passes. The queue changes at (arrivals - what the saturated engines process): with the fleet that
    change was made on, that gives the arrivals (``_prefill_arrivals``); the backlog expected when new
    replicas are ready, drained in ``prefill_drain_s``, asks for more. Until a rate is measured, the
    queue over ``context_length`` is the load, as upstream's.
    """
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := _capacity_unknown(pool, "context_length")) is not None:
        return unknown, view.state
    up, down, target = th.prefill_up, th.prefill_down, th.prefill_target
    queued = [float(e.record.queued_requests.sum_prefill_tokens) for e in pool.engines]
    # ``_capacity_unknown`` held every engine without a context length above: ``or 1`` only narrows the type.
    loads = [q / (e.capacity.context_length or 1) for q, e in zip(queued, pool.engines, strict=True)]
    rate = view.state.engine_rate
    for e, q in zip(pool.engines, queued, strict=True):
        s = e.record.scheduled_requests
        if q > 0 and s.sum_prefill_tokens > 0 and e.record.wall_time > 0:
            r = s.sum_prefill_tokens / e.record.wall_time
            rate = r if rate is None else 0.8 * rate + 0.2 * r
    backlog = sum(queued)
    samples = _trend(view, backlog, now)
    # The queue's growth over the last interval, not over the whole trend window: a burst's first
    # seconds must not be averaged with the quiet minute before it (the queue integrates arrivals,
    # so two samples are enough).
    recent = samples[-2:]
    slope = trend_slope(recent)
    st = replace(view.state, trend=samples, engine_rate=rate)
    sig = Signals(
        queued_prefill_tokens=int(backlog),
        engine_rate_tok_s=None if rate is None else round(rate, 1),
    )
    saturated = sum(1 for ld in loads if ld >= up)
    engines_then, saturated_then = view.state.prefill_engines or (len(loads), saturated)
    st = replace(st, prefill_engines=(len(loads), saturated))
    busy = arrival_engines(view, rate)
    if busy is not None:
        sig = replace(sig, arrival_engines=round(busy, 3))
    if rate is None or rate <= 0 or saturated == 0:
        return _size(view, loads, None, None, slope, up, down, target, sig, busy=busy), st
    deficit = max(slope, 0.0) / rate
    # Until the replicas already asked for serve, the queue keeps growing at this rate.
    probe = view.state.startup_probe
    lead = view.lead_s if probe is None else max(view.lead_s - (now - probe[0]), 0.0)
    growth = min(max(slope, 0.0) * lead, cfg.projection_cap * max(backlog, 1.0) * 10)
    # A queue that would wait longer than half the TTFT target needs more engines now, growing or not.
    wait_s = max(queued) / rate
    sig = replace(sig, queue_wait_s=round(wait_s, 3))
    # Only while the queue is not shrinking and nothing is on its way: under round-robin routing a
    # backlog stays on its engine, and the replicas asked for take new arrivals, not that backlog.
    late = wait_s > 0.5 * cfg.sla.ttft_ms / 1000.0 and slope >= 0 and view.starting == 0
    demand = _prefill_arrivals(engines_then, saturated_then, saturated, slope / rate)
    # Draining a backlog may at most double the fleet: under round-robin routing a backlog stays on
    # the engines that hold it, so more engines beyond that only take new arrivals off them.
    drain = min((backlog + growth) / (rate * cfg.prefill_drain_s), demand)
    projected = demand + drain * target  # the drain term is already in engines at the target
    sig = replace(sig, deficit_engines=round(deficit, 3), drain_engines=round(drain, 3))
    sizing = _size(view, loads, demand, projected, slope, up, down, target, sig, late=late, busy=busy)
    if cfg.prefill_second_look and sizing.want == "up" and not late and saturated_then == 0:
        # A queue the previous decision did not see, short of the TTFT target: a Poisson burst on a busy
        # pool makes one (a steady 8 req/s of 8,000-token prompts on 2 engines: 30-70k tokens, 0.5-0.8 s,
        # gone 5 s later); a pool that is short keeps it, and scales up one interval later.
        why = sizing.why + f"; a {wait_s:.2f}s queue new since the last decision: scaling if it stays"
        return replace(sizing, want="steady", why=why, needed=None), st
    if not cfg.hold_prefill_drain and sizing.want == "up":
        # The drain's replicas are for a backlog that ends: once it has drained, only the arrivals' need
        # is held against a dip (docs/planner.md, "Sizing").
        sizing = replace(sizing, held_need=_needed_replicas(demand / target, pool))
    return sizing, st


def _prefill_arrivals(engines_then: int, saturated_then: int, saturated: int, queue_slope: float) -> float:
    """Engines' worth of arrivals at the prefill pool, from the fleet its queue's latest change was made on.

    ``queue_slope`` is that change in engines (tokens/s over one engine's rate). While the queue grows,
    the engines then were all busy and the growth is a deficit on top: ``engines_then + queue_slope``.
    While it shrinks, under round-robin routing each engine receives the same share of arrivals and only
    the saturated ones' queues move, each by (its share - one engine): the pool receives
    ``engines_then x (1 + queue_slope / saturated_then)``. Counting every engine publishing now as busy
    instead reads a backlog left on the old engines as work for the new ones: on the fleet scale's peak,
    38 engines read as 38 + 12.5 when 25 carried it (docs/planner.md). Never fewer than the engines
    saturated now: a queue behind its pass keeps an engine busy. (Round-robin is the frontend's default
    ``--router-mode``; under ``least-loaded`` or ``kv``, which send new arrivals to idle engines, this
    reads low while the old ones drain and the pool holds: new engines that fall short saturate in turn,
    and their growth reads.)
    """
    if queue_slope >= 0 or saturated_then <= 0:
        arrivals = engines_then + max(queue_slope, 0.0)
    else:
        arrivals = engines_then * (1.0 + queue_slope / saturated_then)
    return max(arrivals, float(saturated))


def _size(
    view: PoolView,
    loads: list[float],
    demand: float | None,
    projected: float | None,
    slope: float,
    up: float,
    down: float,
    target: float,
    sig: Signals,
    sustained: bool = False,
    late: bool = False,
    rising: bool = False,
    busy: float | None = None,
) -> Sizing:
    """Up / down / steady from per-engine loads and (when known) the projected demand.

    ``busy``: engines' worth of work the measured arrivals bring (prefill); spread over the engines left
    after a scale-down it is a load too (times ``up``), so a busy pool without a queue is not consolidated.
    """
    pool = view.pool
    note = ""
    name = pool.name
    mx = max(loads)
    cons, silent, remaining = _consolidated(loads, pool, up)
    by_arrivals = False
    if busy is not None:
        spread_busy = busy / remaining * up if remaining > 0 else math.inf
        if spread_busy > cons:
            cons, by_arrivals = spread_busy, True
    sig = replace(
        sig,
        loads=_summ(loads),
        up=up,
        down=down,
        target=target,
        consolidated=round(cons, 4) if math.isfinite(cons) else None,
    )
    silent_busy = max(silent - view.starting * _per_worker(pool), 0.0)
    if demand is not None and projected is not None and silent_busy:
        # Replicas that should publish and do not count as loaded at ``up`` (never as idle).
        demand, projected = demand + silent_busy * up, projected + silent_busy * up
    needed: int | None = None
    needed_now: int | None = None
    if projected is not None and demand is not None:
        # Today's demand triggers a scale-up; the trend only says how many to add at once.
        needed_now = _needed_replicas(demand / target, pool)
        needed = max(_needed_replicas(projected / target, pool), needed_now)
        sig = replace(sig, needed=needed)

    def sizing(want: Want, why: str, n: int | None = needed) -> Sizing:
        return Sizing(
            want,
            why,
            load_max=mx,
            demand=None if demand is None else round(demand, 4),
            projected=None if projected is None else round(projected, 4),
            needed=n,
            consolidated=cons if math.isfinite(cons) else None,
            slope=round(slope, 6),
            signals=sig,
        )

    # Starting replicas will take their share: the load of the busiest engine once they serve.
    spread = mx * pool.workers / max(pool.workers + view.starting, 1)
    over = spread >= up if name == "prefill" else spread > up
    # With a sizing model, today's demand triggers; without one (no rate measured yet), an engine over ``up``.
    trigger = over
    if needed_now is not None and needed is not None and demand is not None:
        # The trend triggers only on a load that is already a real share of the pool (a quarter of what its
        # replicas carry at the target): a warm-up's few requests rise "consistently" too.
        ahead = (
            sustained
            and needed > view.replicas
            and demand >= 0.25 * target * view.replicas * _per_worker(pool)
        )
        trigger = needed_now > view.replicas or ahead or late
    if trigger:
        n = needed if needed is not None else view.replicas + 1
        if late:
            n = max(n, view.replicas + 1)
        why = f"{name} load {mx:.2f} over {up:g}" if over else f"{name} load {mx:.2f}"
        if projected is not None and demand is not None:
            why += f"; demand {demand:.2f} engines, {projected:.2f} expected in {view.lead_s:.0f}s"
            why += f" -> {n} replicas at {target:g}"
        return sizing("up", why + note, n)
    if silent_busy:
        note += f" ({silent_busy:g} silent engines counted at {up:g})"
    if mx < down:
        limit = up * view.cfg.consolidation_headroom
        if slope > 0 and needed is not None and needed >= view.replicas:
            why = f"{name} load {mx:.2f} under {down:g} but rising: {needed} replicas needed within a startup"
            return sizing("steady", why + note)
        if rising:
            # A consistent rise near a trough accelerates (a wave's upswing): a straight line through the
            # window under-projects it, and a replica released now is missed one cold start later.
            why = f"{name} load {mx:.2f} under {down:g} but rising steadily (r2 {sig.trend_r2})"
            return sizing("steady", why + note)
        if cons < limit:
            return sizing(
                "down",
                f"{name} load {mx:.2f} under {down:g}; "
                f"on {remaining:g} engines {cons:.2f} < {limit:.2f}{note}",
            )
        if remaining <= 0:
            why = f"{name} load {mx:.2f} under {down:g}; a single replica, nothing to consolidate"
        elif by_arrivals:
            why = (
                f"{name} load {mx:.2f} under {down:g}, but the arrivals keep {busy:.2f} engines busy: "
                f"on {remaining:g} engines {cons / up:.2f} each >= {view.cfg.consolidation_headroom:g}"
            )
        else:
            why = (
                f"{name} load {mx:.2f} under {down:g} "
                f"but on {remaining:g} engines it would be {cons:.2f} >= {limit:.2f}"
            )
        return sizing("steady", why + note)
    if over and demand is not None:
        # The busiest engine is over ``up`` (a backlog round-robin routing leaves where it is), but the
        # pool's demand fits the replicas it has (and has asked for) at the target.
        why = (
            f"{name} load {mx:.2f} over {up:g} on its busiest engine, but a demand of {demand:.2f} engines "
            f"fits {view.replicas} replicas at {target:g}"
        )
        return sizing("steady", why + note)
    return sizing("steady", f"{name} load {mx:.2f} within [{down:g}, {up:g}]{note}")


def _sla_sizing(view: PoolView) -> Sizing:
    """``target: sla``: the online latency models predict TTFT / ITL per engine; one step at a time."""
    pool, cfg = view.pool, view.cfg
    fit = pool.latency
    assert fit is not None  # pool_sizing falls back to the thresholds without a model
    engines = pool.engines
    n = len(engines)
    head = cfg.sla.headroom
    if pool.name == "prefill":
        target = cfg.sla.ttft_ms / 1000.0
        a, b = fit.coef

        def ttft(q: float, chunk: int | None) -> float:
            """Time to compute ``q`` queued tokens in passes of at most ``chunk`` tokens."""
            c = chunk or max(q, 1.0)
            passes = max(1.0, math.ceil(q / c))
            return passes * max(a + b * min(q, c), 0.0)

        qs = [float(e.record.queued_requests.sum_prefill_tokens) for e in engines]
        est = [ttft(q, e.capacity.max_num_batched_tokens) for q, e in zip(qs, engines, strict=True)]
        ratios = [x / target for x in est]
        sig = Signals(ttft_est_s=_summ(est), ttft_target_s=target, samples=fit.samples)
        cons = (
            ttft(sum(qs) / (n - 1), engines[0].capacity.max_num_batched_tokens) / target
            if n > 1
            else math.inf
        )
        kv_over = False
    else:
        target = cfg.sla.itl_ms / 1000.0
        demands = [decode_demand(e, cfg.transfer_bound_weight, 1.0) for e in engines]
        reqs = [dd.requests for dd in demands]
        kvs = [dd.tokens for dd in demands]
        a, b, c = fit.coef
        est = [max(a + b * r + c * k, 0.0) for r, k in zip(reqs, kvs, strict=True)]
        ratios = [x / target for x in est]
        caps = [e.capacity.kv_tokens for e in engines]
        kv_over = any(c and k > c for k, c in zip(kvs, caps, strict=True)) or any(
            e.capacity.max_num_seqs and r > e.capacity.max_num_seqs
            for r, e in zip(reqs, engines, strict=True)
        )
        cons = fit.predict(sum(reqs) / (n - 1), sum(kvs) / (n - 1)) / target if n > 1 else math.inf
        cap_min = min((c for c in caps if c), default=None)
        if n > 1 and cap_min and sum(kvs) / (n - 1) > cap_min * head:
            cons = math.inf
        sig = Signals(itl_est_s=_summ(est), itl_target_s=target, samples=fit.samples, kv_over=kv_over)
    if pool.replicas > pool.workers:
        cons = math.inf  # silent replicas: their load is unknown, so no consolidation
    mx = max(ratios)
    finite = cons if math.isfinite(cons) else None
    sig = replace(sig, consolidated=None if finite is None else round(cons, 4))
    if min(ratios) > 1.0 or kv_over:
        why = f"{pool.name} predicted latency {mx:.2f}x the SLA on every engine"
        return Sizing("up", why, mx, needed=view.replicas + 1, consolidated=finite, signals=sig)
    if cons <= head:
        why = f"{pool.name} on {n - 1} engines predicted at {cons:.2f}x the SLA <= {head:g}"
        return Sizing("down", why, mx, consolidated=finite, signals=sig)
    why = f"{pool.name} predicted latency {mx:.2f}x the SLA"
    return Sizing("steady", why, mx, consolidated=finite, signals=sig)


def pool_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool = view.pool
    if not pool.engines:
        return Sizing("idle", f"{pool.name}: no engines publishing"), view.state
    if all(engine_idle(e) for e in pool.engines):
        st = replace(view.state, trend=((now, 0.0),))
        if pool.name == "prefill":
            st = replace(st, prefill_engines=(len(pool.engines), 0))
        return Sizing("idle", f"{pool.name}: no scheduled or queued work on {len(pool.engines)} engines"), st
    cfg = view.cfg
    if cfg.target == "sla":
        fit = pool.latency
        if fit is not None and fit.samples >= cfg.sla.min_samples:
            return _sla_sizing(view), view.state
        n = 0 if fit is None else fit.samples
        sizing, st = (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)
        return replace(sizing, why=sizing.why + f" (latency model not ready: {n} samples; thresholds)"), st
    return (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)


# --------------------------------------------------------------------------------------------------
# The rules.


@dataclass(slots=True)
class Draft:
    """One pool's decision in the making; each rule reads and refines it."""

    name: PoolName
    pool: PoolObs
    st: PoolState
    replicas: int  # capacity counted: running + asked for and still starting
    desired: int
    action: Action
    reason: str
    signals: Signals
    sizing: Sizing | None = None
    done: bool = False

    def decide(self, desired: int, reason: str, st: PoolState | None = None) -> Draft:
        self.desired = desired
        self.action = (
            "scale_up"
            if desired > self.pool.replicas
            else "scale_down"
            if desired < self.pool.replicas
            else "hold"
        )
        self.reason = reason
        if st is not None:
            self.st = st
        self.done = True
        return self

    def hold(self, reason: str, st: PoolState | None = None, desired: int | None = None) -> Draft:
        self.decide(self.pool.replicas, reason, st)
        if desired is not None:
            self.desired = desired  # the pending target: the planner still wants it (logs, metrics)
        return self


def _lead(st: PoolState, cfg: PlannerConfig) -> float:
    return st.startup_s if st.startup_s is not None else cfg.expected_startup_s


def rule_first_look(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    """A planner's first look records the fleet it found as a need, so the stabilization holds it.

    A planner that has just started (or restarted) knows nothing of the load before it: the fleet it finds
    is what the operator or its previous self sized. Like the HPA, which seeds its recommendations with the
    current replica count, it scales that fleet down no sooner than ``scale_down_stabilization_s`` (idle
    pools excepted: ``rule_idle`` does not read the needs).
    """
    if d.st.first_look_at is not None:
        return
    window = cfg.scale_down_stabilization_s
    needs = _within(d.st.needs, window, obs.now, d.pool.replicas) if window > 0 else d.st.needs
    d.st = replace(d.st, first_look_at=obs.now, first_look_replicas=d.pool.replicas, needs=needs)


def rule_in_flight(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    """Starting replicas are capacity to come; a drain in flight holds; a stuck action is given up."""
    fl = d.st.in_flight
    if fl is None:
        return
    now, pool = obs.now, d.pool
    up = fl.target >= fl.previous
    reached = pool.workers >= fl.target if up else pool.workers <= fl.target
    if reached and (obs.settled or up):
        # Only a landing slower than ``late_landing_s`` is late (see ``rule_late_landing``).
        late = up and cfg.late_landing_s is not None and now - fl.since >= cfg.late_landing_s
        d.st = replace(d.st, in_flight=None, landed=(now, fl.previous) if late else None)
        return
    if now - fl.since >= cfg.action_timeout_s:
        pc = cfg.pool(d.name)
        running = min(max(pool.workers, pc.min_replicas), pc.max_replicas)
        reason = (
            f"action {fl.previous}->{fl.target} not done after {now - fl.since:.0f}s "
            f"({pool.workers} workers publishing); abandoning it and asking for {running}"
        )
        st = replace(
            d.st,
            in_flight=InFlight(running, fl.target, now),
            last_action_at=now,
            down_since=None,
            startup_probe=None,
        )
        d.decide(running, reason, st)
        return
    left = cfg.action_timeout_s - (now - fl.since)
    state = "settled" if obs.settled else "connector busy"
    if not up:
        d.hold(
            f"waiting for action {fl.previous}->{fl.target} ({pool.workers} publishing, {state}; "
            f"gives up in {left:.0f}s)",
            desired=fl.target,
        )
        return
    # A scale-up in flight: size on top of it (never below what was asked for).
    d.replicas = max(d.replicas, fl.target)
    d.signals = replace(d.signals, starting=max(fl.target - pool.workers, 0))
    d.reason = (
        f"waiting for action {fl.previous}->{fl.target} ({pool.workers} publishing, {state}; "
        f"gives up in {left:.0f}s)"
    )


def rule_bounds(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    pc = cfg.pool(d.name)
    cur = d.pool.replicas
    if d.replicas < pc.min_replicas:
        d.decide(pc.min_replicas, f"{cur} replicas, below min_replicas {pc.min_replicas}")
    elif cur > pc.max_replicas:
        d.decide(
            max(cur - cfg.scale_down_step, pc.max_replicas),
            f"{cur} replicas, above max_replicas {pc.max_replicas}",
        )


def _starting(d: Draft, status_starting: int | None) -> int:
    """Replicas still starting: the connector's count, never more than those not publishing yet."""
    silent = max(d.replicas - d.pool.workers, 0)
    if status_starting is not None:
        return min(status_starting, silent)
    return silent if d.st.in_flight is not None else 0


def rule_mismatch(d: Draft, obs: Observation, cfg: PlannerConfig) -> int:
    """Replicas that should publish but do not (starting ones excepted): hold, then count them busy."""
    now, pool = obs.now, d.pool
    missing = pool.replicas - pool.workers - _starting(d, pool.starting)
    if pool.replicas < pool.workers:
        missing = pool.replicas - pool.workers
    elif missing < 0:
        missing = 0
    since = (d.st.mismatch_since if d.st.mismatch_since is not None else now) if missing else None
    d.st = replace(d.st, mismatch_since=since)
    if not missing:
        return 0
    waited = now - (since if since is not None else now)
    d.signals = replace(d.signals, mismatch_s=round(waited, 3))
    if waited < cfg.mismatch_grace_s:
        what = "not publishing (stale, starting or gone)" if missing > 0 else "extra, not counted as replicas"
        d.hold(
            f"{pool.replicas} replicas but {pool.workers} workers publishing ({abs(missing)} {what}); "
            f"holding, {cfg.mismatch_grace_s - waited:.0f}s of grace left",
            replace(d.st, down_since=None, idle_since=None),
        )
    return missing


def rule_late_landing(d: Draft, obs: Observation, cfg: PlannerConfig) -> None:
    """Replicas that landed after the load that asked for them had gone are not held by the stabilization.

    The stabilization window keeps what the sizing needed so that a dip between two needs does not release
    replicas the load wants back. A decode scale-up that took at least ``late_landing_s`` to land and
    then, within one startup, finds the pool wanting down with its demand under ``decode_down`` times the
    replicas it had before the ask answered a burst shorter than the startup: the needs recorded before
    the landing are forgotten and the usual scale-down (window, step) follows. A faster startup keeps the
    window's anti-flap role (a re-ask costs seconds); decode only, because an unsaturated prefill pool's
    records cannot say how close to saturation it is; threshold targets only (``sla`` sizes no demand).
    """
    landed = d.st.landed
    if landed is None:
        return
    at, before = landed
    s = d.sizing
    if d.name != "decode" or obs.now - at > _lead(d.st, cfg):
        d.st = replace(d.st, landed=None)
        return
    floor = cfg.effective_thresholds().decode_down * before  # what the replicas before it carry, well under
    if s is not None and s.want == "down" and s.demand is not None and s.demand <= floor:
        d.st = replace(d.st, landed=None, needs=tuple(x for x in d.st.needs if x[0] > at))
        d.signals = replace(d.signals, late_landing_from=before)
        why = f"; the scale-up from {before} landed after its load: not held by the stabilization"
        d.sizing = replace(s, why=s.why + why)


def rule_idle(d: Draft, obs: Observation, cfg: PlannerConfig, missing: int) -> None:
    s = d.sizing
    if s is None or s.want != "idle":
        d.st = replace(d.st, idle_since=None)
        return
    now, pc, cur = obs.now, cfg.pool(d.name), d.pool.replicas
    if missing > 0:
        # Silent replicas count as busy: a NATS outage must not read as "traffic stopped".
        d.hold(
            s.why + f"; {missing} of {cur} replicas not publishing count as busy, no scale-down",
            replace(d.st, idle_since=None, down_since=None),
        )
        return
    since = d.st.idle_since if d.st.idle_since is not None else now
    st = replace(d.st, idle_since=since, down_since=None)
    if cur <= pc.min_replicas:
        d.hold(s.why + f"; at minimum {pc.min_replicas}", st)
    elif d.st.in_flight is not None:
        d.hold(s.why + "; a scale-up is still starting", st, desired=d.replicas)
    elif now - since >= cfg.idle_window_s:
        to = max(cur - cfg.scale_down_step, pc.min_replicas)
        d.decide(to, s.why + f" for {now - since:.0f}s; stepping down towards minimum {pc.min_replicas}", st)
    else:
        d.hold(s.why + f"; idle {now - since:.0f}s of {cfg.idle_window_s:g}s before stepping down", st)


def rule_load(d: Draft, obs: Observation, cfg: PlannerConfig, missing: int) -> None:
    s = d.sizing
    assert s is not None
    now, pc, cur = obs.now, cfg.pool(d.name), d.pool.replicas
    if s.want == "up":
        d.st = replace(d.st, down_since=None)
        want = min(s.needed if s.needed is not None else d.replicas + 1, pc.max_replicas)
        if cfg.max_scale_up_step is not None:
            want = min(want, d.replicas + cfg.max_scale_up_step)
        if d.replicas >= pc.max_replicas:
            d.hold(s.why + f"; at max_replicas {pc.max_replicas}", desired=max(d.replicas, cur))
        elif want <= d.replicas:
            d.hold(s.why + f"; {d.replicas} replicas (with those starting) carry it", desired=d.replicas)
        else:
            starting = d.replicas - cur
            d.decide(want, s.why + (f" ({starting} starting counted)" if starting > 0 else ""))
        return
    if d.st.in_flight is not None:
        # A scale-up is still starting: never reverse it before it has landed.
        d.hold(d.reason + "; " + s.why, replace(d.st, down_since=None), desired=d.replicas)
        return
    if s.want == "down":
        window = cfg.scale_down_stabilization_s
        held = [(t, n) for t, n in d.st.needs if now - t <= window]
        recent = max((n for _, n in held), default=0)
        if recent >= cur:
            first = d.st.first_look_at
            # Found at the first look, not asked for by that tick's sizing (both are recorded at that time).
            found = recent == d.st.first_look_replicas
            if first is not None and found and all(t == first for t, n in held if n == recent):
                why = f"; the {recent} replicas found at the planner's first look {now - first:.0f}s ago"
            else:
                why = f"; {recent} replicas were needed within {window:g}s"
            d.hold(s.why + why + " (stabilization)", replace(d.st, down_since=None))
            return
        if missing > 0:
            d.hold(
                s.why + f"; but {missing} replicas are not publishing (counted as busy), no scale-down",
                replace(d.st, down_since=None),
            )
            return
        since = d.st.down_since if d.st.down_since is not None else now
        st = replace(d.st, down_since=since)
        if cur <= pc.min_replicas:
            d.hold(s.why + f"; at min_replicas {pc.min_replicas}", st)
        elif now - since >= cfg.scale_down_window_s:
            floor = max(pc.min_replicas, s.needed or 0, recent, cur - cfg.scale_down_step)
            if floor >= cur:
                d.hold(s.why + f"; {s.needed} replicas needed", st)
            else:
                d.decide(floor, s.why + f"; wanted for {now - since:.0f}s", st)
        else:
            d.hold(s.why + f"; wanted for {now - since:.0f}s of {cfg.scale_down_window_s:g}s", st)
        return
    d.hold(s.why, replace(d.st, down_since=None))


def _probe_startup(st: PoolState, pool: PoolObs, now: float) -> PoolState:
    """Measure the time from a scale-up to the first record of a new replica (EWMA)."""
    probe = st.startup_probe
    if probe is None or pool.workers <= probe[1]:
        return st
    took = now - probe[0]
    est = took if st.startup_s is None else 0.5 * st.startup_s + 0.5 * took
    return replace(st, startup_s=est, startup_probe=None)


def draft_pool(name: PoolName, obs: Observation, st: PoolState, cfg: PlannerConfig) -> Draft:
    pool = obs.pool(name)
    st = _probe_startup(st, pool, obs.now)
    sources: dict[str, int] = {}
    for e in pool.engines:
        sources[e.capacity.source] = sources.get(e.capacity.source, 0) + 1
    sig = Signals(
        replicas=pool.replicas,
        workers=pool.workers,
        engines=len(pool.engines),
        capacity_from=sources or None,
        rejected_records=pool.rejected or None,
        lead_s=round(_lead(st, cfg), 1),
        startup_measured=st.startup_s is not None,
    )
    d = Draft(name, pool, st, pool.replicas, pool.replicas, "hold", "", sig)
    rule_first_look(d, obs, cfg)
    rule_in_flight(d, obs, cfg)
    if d.done:
        return d
    rule_bounds(d, obs, cfg)
    if d.done:
        return d
    missing = rule_mismatch(d, obs, cfg)
    if d.done:
        return d
    view = PoolView(
        pool,
        d.st,
        cfg,
        d.replicas,
        _lead(d.st, cfg),
        _starting(d, pool.starting),
        obs.arrivals if cfg.use_arrivals else None,
    )
    sizing, d.st = pool_sizing(view, obs.now)
    d.sizing = sizing
    if sizing.want == "up" and sizing.needed is not None:
        held = sizing.needed if sizing.held_need is None else sizing.held_need
        need = min(held, cfg.pool(name).max_replicas)
        d.st = replace(d.st, needs=_within(d.st.needs, cfg.scale_down_stabilization_s, obs.now, need))
    d.signals = replace(d.signals.merged(sizing.signals), want=sizing.want)
    rule_late_landing(d, obs, cfg)
    rule_idle(d, obs, cfg, missing)
    if d.done:
        return d
    rule_load(d, obs, cfg, missing)
    return d


def _fits_consolidated(d: Draft, cfg: PlannerConfig) -> bool:
    """Whether this pool could give one replica away (for a rebalance) without overloading."""
    s = d.sizing
    if s is None or d.st.in_flight is not None or d.pool.replicas <= cfg.pool(d.name).min_replicas:
        return False
    if s.want in ("idle", "down"):
        return d.pool.workers >= d.pool.replicas
    if s.want != "steady" or s.consolidated is None:
        return False
    th = cfg.effective_thresholds()
    up = th.prefill_up if d.name == "prefill" else th.decode_up
    limit = cfg.sla.headroom if cfg.target == "sla" else up * cfg.consolidation_headroom
    return s.consolidated < limit and d.pool.workers >= d.pool.replicas


def apply_interval_guard(
    drafts: dict[PoolName, Draft], state: PolicyState, cfg: PlannerConfig, now: float
) -> None:
    """At most one action per pool per interval, even if decide() is called more often (half an interval of
    slack)."""
    for d in drafts.values():
        last = state.pool(d.name).last_action_at
        if (
            d.action != "hold"
            and d.desired != d.pool.replicas
            and last is not None
            and now - last < cfg.interval_s * 0.5
        ):
            d.reason += f"; last step {now - last:.1f}s ago (< interval {cfg.interval_s:g}s)"
            d.desired, d.action = d.replicas, "hold"


def apply_decode_follows_prefill(drafts: dict[PoolName, Draft], cfg: PlannerConfig) -> None:
    """While the prefill pool scales up (asked for now, or still starting), decode does not scale down.

    In disaggregated serving every prompt prefill takes on becomes decode work one prefill later, so a
    prefill scale-up says arrivals rose before the decode engines' records can (numbers: docs/planner.md).
    Only the sizing's scale-downs (load, idle) are held: bounds, abandoned actions and rebalances are not;
    and only while prefill workers publish (an aggregated deployment has none to scale).
    """
    if not cfg.decode_follows_prefill:
        return
    pre, dec = drafts["prefill"], drafts["decode"]
    if pre.pool.workers == 0:
        return
    fl = pre.st.in_flight
    if pre.action == "scale_up":
        to = pre.desired
    elif fl is not None and fl.target > fl.previous:
        to = fl.target
    else:
        return
    if dec.action != "scale_down" or dec.sizing is None or dec.sizing.want not in ("down", "idle"):
        return
    dec.desired, dec.action = dec.pool.replicas, "hold"
    dec.reason += f"; held: prefill is scaling up to {to} (decode work follows)"
    dec.signals = replace(dec.signals, prefill_rising_to=to)
    dec.st = replace(dec.st, down_since=None, idle_since=None)


def _holding(d: Draft) -> int:
    """Replicas that may hold GPUs before this decision: a draining scale-down still holds its old count."""
    n = max(d.pool.replicas, d.pool.workers, d.replicas)
    if d.st.in_flight is not None:
        n = max(n, d.st.in_flight.target, d.st.in_flight.previous)
    return n


def _held(d: Draft) -> int:
    """Replicas that may hold GPUs once this decision is sent."""
    return max(_holding(d), d.desired)


def apply_budget(drafts: dict[PoolName, Draft], cfg: PlannerConfig) -> None:
    """Scale-ups, the most loaded pool first, within the GPU budget; a cut ask, or a rebalance."""
    budget = cfg.gpu_budget
    if budget is None:
        return
    ups = sorted(
        (d for d in drafts.values() if d.action == "scale_up"),
        key=lambda d: -(d.sizing.load_max if d.sizing else 0.0),
    )
    for d in ups:
        o = drafts[other(d.name)]
        gpr = cfg.pool(d.name).gpus_per_replica
        used = _held(d) * gpr + _held(o) * cfg.pool(o.name).gpus_per_replica
        d.signals = replace(d.signals, gpus_after=used)
        if used <= budget:
            continue
        want = d.desired
        base = _holding(d)
        free = budget - _held(o) * cfg.pool(o.name).gpus_per_replica
        fits = free // gpr if gpr else want
        if fits > base:
            d.desired = min(want, fits)
            d.reason += f"; cut to {d.desired} by the GPU budget {budget}"
            after = d.desired * gpr + _held(o) * cfg.pool(o.name).gpus_per_replica
            d.signals = replace(d.signals, gpus_after=after)
            continue
        d.desired, d.action = d.replicas, "hold"
        if o.action == "scale_down" or o.desired < o.pool.replicas:
            d.reason += (
                f"; GPU budget {budget} would be exceeded ({used}); waiting for {o.name} to scale down"
            )
        elif o.action == "hold" and _fits_consolidated(o, cfg):
            o.desired, o.action = o.pool.replicas - 1, "scale_down"
            o.reason = (
                f"rebalance: releasing one {o.name} replica so {d.name} can go to {want} "
                f"within the GPU budget {budget} ({o.reason})"
            )
            o.st = replace(o.st, down_since=None)
            d.reason += f"; GPU budget {budget} would be exceeded ({used}); rebalancing from {o.name} first"
        else:
            d.reason += f"; GPU budget {budget} would be exceeded ({used}) and {o.name} cannot give a replica"


def _signals(d: Draft) -> Signals:
    s = d.sizing
    if s is None:
        return d.signals
    return d.signals.merged(Signals(demand=s.demand, projected=s.projected, slope=s.slope))


def decide(obs: Observation, state: PolicyState, cfg: PlannerConfig) -> tuple[Decision, PolicyState]:
    """One decision for both pools. Pure: same inputs, same output."""
    drafts = {name: draft_pool(name, obs, state.pool(name), cfg) for name in POOLS}
    now = obs.now
    apply_interval_guard(drafts, state, cfg, now)
    apply_decode_follows_prefill(drafts, cfg)
    apply_budget(drafts, cfg)
    decisions: dict[PoolName, PoolDecision] = {}
    new_state = state
    for name, d in drafts.items():
        st = d.st
        # A new target: more than the capacity already counted (running + starting), or a scale-down.
        if d.action != "hold" and d.desired != (d.replicas if d.action == "scale_up" else d.pool.replicas):
            fl = st.in_flight
            previous = fl.previous if fl is not None and d.action == "scale_up" else d.pool.replicas
            st = replace(
                st,
                in_flight=InFlight(d.desired, previous, now),
                last_action_at=now,
                down_since=None,
            )
            if d.action == "scale_up" and st.startup_probe is None:
                # This ask's first replica is the one after everything already running or starting
                # (``d.replicas``): counting from the workers publishing now would time an earlier
                # ask's replica, which lands sooner (measured 28 s on a 60 s cold start).
                st = replace(st, startup_probe=(now, max(d.replicas, d.pool.workers)))
        if cfg.gpu_budget is not None:
            d.signals = replace(d.signals, gpu_budget=cfg.gpu_budget)
        decisions[name] = PoolDecision(
            name,
            d.pool.replicas,
            d.desired,
            d.action,
            d.reason,
            d.pool.workers,
            len(d.pool.engines),
            d.sizing,
            _signals(d),
        )
        new_state = new_state.with_pool(name, st)
    return Decision(now, decisions["prefill"], decisions["decode"]), new_state


def sent_now(state: PolicyState, now: float) -> list[PoolName]:
    """Pools whose new target was set at ``now`` (what the loop must send to the connector)."""
    return [p for p in POOLS if (fl := state.pool(p).in_flight) is not None and fl.since == now]


def settle(state: PolicyState, *, dry_run: bool = False, failed: Iterable[PoolName] = ()) -> PolicyState:
    """The connector's outcome applied to the state: nothing will happen (dry run), or a send failed.

    A dry run waits for nothing; a failed send clears that pool's in-flight action so the policy asks
    again at the next interval instead of waiting for an action that never started.
    """
    failed = set(failed)
    for p in POOLS:
        st = state.pool(p)
        if dry_run or p in failed:
            state = state.with_pool(p, replace(st, in_flight=None, startup_probe=None))
    return state
