"""The demo's verdict (pure, no I/O): the planner's decisions, and whether the replica it added took load.

The load is decode-heavy by design (short prompts, long generations), so the right answer is: scale the
decode pool up during the burst, never touch the prefill pool upwards, bring both back to their minimum
once the load is gone, and - judged by outcome, not by decisions - the added decode replica must schedule
work soon after the decision and carry a fair share of the burst's decode tokens (``outcome.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo.planner.decision_log import DecisionEntry

from .outcome import ScaledReplica, describe


@dataclass(frozen=True)
class Verdict:
    decode_scaled_up: bool
    decode_up_after_s: float | None  # from the burst's start to the first decode scale-up decision
    decode_peak: int
    prefill_scaled_up: bool
    wrong_pool_actions: list[DecisionEntry] = field(default_factory=list)
    final_replicas: dict[str, int] = field(default_factory=dict)
    returned_to_min: bool = False
    back_to_min_after_s: float | None = None  # from the burst's end to the last pool reaching its minimum
    lines: tuple[str, ...] = ("", "", "")
    scaled: ScaledReplica | None = None  # None: not judged (the planner was off)

    @property
    def took_load(self) -> bool:
        return self.scaled is not None and self.scaled.took_load

    @property
    def passed(self) -> bool:
        return (
            self.decode_scaled_up and not self.wrong_pool_actions and self.returned_to_min and self.took_load
        )


def final_replicas(decisions: list[DecisionEntry], minimum: dict[str, int]) -> dict[str, int]:
    """Replicas per pool after the last decision (the minimum when a pool had no decision)."""
    out = dict(minimum)
    for d in decisions:
        out[d.pool] = d.desired
    return out


def judge(
    decisions: list[DecisionEntry],
    burst_start: float,
    burst_end: float,
    minimum: dict[str, int],
    grace_s: float = 30.0,
    scaled: ScaledReplica | None = None,
) -> Verdict:
    """Judge the planner: right pool during the burst, speed, wrong-pool actions, back to minimum, and
    (``scaled``, see ``outcome.scaled_replica``) whether the added replica took load.

    ``grace_s``: a decode scale-up this long after the burst's end still counts as a reaction to it.
    """
    decisions = sorted(decisions, key=lambda d: d.ts)
    decode_ups = [
        d
        for d in decisions
        if d.pool == "decode" and d.direction > 0 and burst_start <= d.ts <= burst_end + grace_s
    ]
    prefill_ups = [d for d in decisions if d.pool == "prefill" and d.direction > 0]
    # Wrong pool: any prefill scale-up (the load never needs more prefill), and a decode scale-down
    # while the burst is still running.
    wrong = prefill_ups + [
        d for d in decisions if d.pool == "decode" and d.direction < 0 and burst_start <= d.ts < burst_end
    ]
    wrong.sort(key=lambda d: d.ts)
    peak = max([minimum.get("decode", 1)] + [d.desired for d in decisions if d.pool == "decode"])
    final = final_replicas(decisions, minimum)
    at_min = all(final.get(p, minimum[p]) <= minimum[p] for p in minimum)
    back_after = None
    if at_min:
        last_down = [d.ts for d in decisions if d.direction < 0 and d.ts >= burst_start]
        back_after = max(0.0, max(last_down) - burst_end) if last_down else 0.0
    up_after = decode_ups[0].ts - burst_start if decode_ups else None

    if decode_ups and not prefill_ups:
        first = decode_ups[0]
        line1 = (
            f"Right pool: YES - decode scaled {first.current} -> {first.desired} during the decode-heavy "
            f"burst (peak {peak}); "
            + (
                "prefill never scaled up."
                if minimum.get("prefill", 0) > 0
                else "no prefill pool (aggregated)."
            )
        )
    elif decode_ups:
        line1 = f"Right pool: PARTLY - decode scaled up (peak {peak}), but prefill scaled up too."
    else:
        line1 = "Right pool: NO - the decode pool was never scaled up during the burst."
    line2 = (
        f"How fast: first decode scale-up {up_after:.1f} s after the burst began"
        if up_after is not None
        else "How fast: no decode scale-up decision"
    )
    if back_after is not None:
        line2 += f"; both pools back at their minimum {back_after:.1f} s after the burst ended."
    else:
        line2 += (
            "; NOT back at minimum at the end ("
            + ", ".join(f"{p} {final.get(p)} > {minimum[p]}" for p in minimum if final.get(p, 0) > minimum[p])
            + ")."
        )
    if wrong:
        line3 = f"Wrong-pool actions: {len(wrong)} - " + "; ".join(
            f"{d.pool} {d.current}->{d.desired} at +{d.ts - burst_start:.0f} s ({d.reason})"
            for d in wrong[:3]
        )
    else:
        line3 = "Wrong-pool actions: none."
    return Verdict(
        decode_scaled_up=bool(decode_ups),
        decode_up_after_s=up_after,
        decode_peak=peak,
        prefill_scaled_up=bool(prefill_ups),
        wrong_pool_actions=wrong,
        final_replicas=final,
        returned_to_min=at_min,
        back_to_min_after_s=back_after,
        lines=(line1, line2, line3, describe(scaled if scaled is not None else ScaledReplica())),
        scaled=scaled if scaled is not None else ScaledReplica(),
    )
