"""Windows of (time, value) samples and the least-squares line through them."""

from __future__ import annotations

from collections.abc import Iterable

from .state import SampleValue


def within_window(
    samples: tuple[tuple[float, SampleValue], ...], window: float, now: float, value: SampleValue
) -> tuple[tuple[float, SampleValue], ...]:
    """The (time, value) samples at most ``window`` seconds old, with ``(now, value)`` appended."""
    return (*(x for x in samples if now - x[0] <= window), (now, value))


def span(samples: tuple[tuple[float, float], ...]) -> float:
    return samples[-1][0] - samples[0][0] if samples else 0.0


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
