"""What a decision is made of and says: the typed signals, a pool's sizing, the decision per pool."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from .state import Action, PoolName, Want


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
    target: float | None = None
    consolidated: float | None = None
    needed: int | None = None
    demand: float | None = None
    projected: float | None = None
    slope: float | None = None
    trend_r2: float | None = None
    demand_mean: float | None = None  # the demand window's mean, engines at full load
    demand_spread: float | None = None  # its standard deviation
    # Decode.
    decode_kv_tokens: int | None = None
    queued_decode_kv_tokens: int | None = None
    decode_kv_transfer_tokens: int | None = None
    decode_kv_waiting_tokens: int | None = None
    transfer_bound_engines: int | None = None
    slot_load_max: float | None = None
    trend_rise: float | None = None  # the trend's rise over its window, engines
    trend_noise: float | None = None  # ``forecast.noise_z`` standard deviations of the requests' wander
    completed_per_s: float | None = None  # requests a saturated decode pool completes per second
    throughput_bound: float | None = None  # ``forecast.throughput_cap`` x what the arrivals ahead need
    prefill_rising_to: int | None = None  # a scale-down held: prefill is scaling up to this many replicas
    # Prefill.
    queued_prefill_tokens: int | None = None
    engine_rate_tok_s: float | None = None
    arrival_engines: float | None = None  # engines' worth of work the frontend's arrivals bring
    queue_wait_s: float | None = None  # the longest engine's queue, in seconds of its passes
    late_engines: int | None = None  # engines whose queue waits over half the TTFT target
    drain_engines: float | None = None
    held_kv_engines: float | None = None  # engines' worth of KV held for peers that have not read it
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
    prefill: the arrivals' prompt work, see ``prefill_sizing``); ``projected`` is the window's level plus
    what is wanted on top; ``needed`` is the replica count the sizing asks for.
    """

    want: Want
    why: str
    load_max: float = 0.0
    demand: float | None = None
    projected: float | None = None
    needed: int | None = None
    consolidated: float | None = None
    signals: Signals = Signals()


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
    # The rule that made the decision (``rules`` and ``fleet``): stable names for tests and dashboards.
    code: str = ""

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


def summarise(values: list[float]) -> Summary:
    return Summary(round(max(values), 4), round(sum(values) / len(values), 4), len(values))
