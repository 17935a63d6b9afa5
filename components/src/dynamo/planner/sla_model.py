"""Online least-squares regressions of forward-pass ``wall_time``: the ``sla`` target's latency models,
and the prefill pool's cost of a prompt token (``policy.prefill.arrival_engines``).

Prefill pool: wall_time ~ a + b * prefill tokens computed in the pass.
Decode pool: wall_time ~ a + b * decode requests + c * decode KV tokens.
A sliding window of samples keeps exact sums (add on arrival, subtract on eviction), so a fit costs one
tiny linear solve; a one-feature fit also carries its slope's standard error (one pass over the window).
Only timing samples (``wall_time > 0``) of warm workers are added (the caller enforces that); heartbeats
and queue snapshots are not samples.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from dynamo.common.forward_pass_metrics import ForwardPassMetrics

# A slope is known when it is this many standard errors above zero (about 95% one-sided). Passes of
# nearly one size (a demo's equal prompts) leave the slope to timing noise: on a CPU, one stalled pass
# of two 8-token prompts read as 0.02 s a token and sized a prefill pool at 2 engines for no work.
SLOPE_SIGMAS = 2.0


@dataclass(frozen=True, slots=True)
class LinearFit:
    """A fitted model: ``predict(x) = coef[0] + sum(coef[i+1] * x[i])``. A one-feature fit carries its
    slope's heteroskedasticity-consistent (HC3) standard error: pass times are not equally noisy (a
    stall is one huge residual), and a stall on one of few passes of another size must not make a slope."""

    coef: tuple[float, ...]
    samples: int
    slope_stderr: float | None = None

    def slope_known(self) -> bool:
        """The (first) slope is positive and, when its standard error is known, more than
        ``SLOPE_SIGMAS`` of them above zero."""
        b = self.coef[1]
        if self.slope_stderr is None:
            return b > 0
        return b > SLOPE_SIGMAS * self.slope_stderr

    def predict(self, *x: float) -> float:
        y = self.coef[0]
        for c, v in zip(self.coef[1:], x, strict=True):
            y += c * v
        return max(y, 0.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, n + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


class WindowedRegression:
    """Least squares over the last ``window`` samples, with a small ridge so degenerate data stays
    solvable."""

    def __init__(self, n_features: int, window: int = 512, ridge: float = 1e-9) -> None:
        self.k = n_features + 1
        self.window = window
        self.ridge = ridge
        self._samples: deque[tuple[tuple[float, ...], float]] = deque()
        self._xtx = [[0.0] * self.k for _ in range(self.k)]
        self._xty = [0.0] * self.k

    def _acc(self, x: tuple[float, ...], y: float, sign: float) -> None:
        row = (1.0, *x)
        for i in range(self.k):
            self._xty[i] += sign * row[i] * y
            for j in range(self.k):
                self._xtx[i][j] += sign * row[i] * row[j]

    def add(self, x: tuple[float, ...], y: float) -> None:
        self._samples.append((x, y))
        self._acc(x, y, 1.0)
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._acc(old_x, old_y, -1.0)

    def __len__(self) -> int:
        return len(self._samples)

    def fit(self) -> LinearFit | None:
        n = len(self._samples)
        if n < 2:
            return None
        a = [row[:] for row in self._xtx]
        for i in range(1, self.k):
            a[i][i] += self.ridge * max(1.0, a[i][i])
        coef = _solve(a, self._xty)
        if coef is None:
            # Constant features (all batches alike): the mean is the best we know.
            mean = self._xty[0] / n
            return LinearFit((mean,) + (0.0,) * (self.k - 1), n)
        return LinearFit(tuple(coef), n, self._slope_stderr(coef) if self.k == 2 else None)

    def _slope_stderr(self, coef: list[float]) -> float:
        """HC3 standard error of a one-feature fit's slope (MacKinnon and White, 1985):
        sqrt(sum(dx_i^2 e_i^2 / (1 - h_i)^2)) / Sxx, h_i = 1/n + dx_i^2 / Sxx the sample's leverage.
        Infinite when one sample alone decides the slope (leverage 1) or the sizes do not vary."""
        n = len(self._samples)
        mean_x = sum(x[0] for x, _ in self._samples) / n
        sxx = sum((x[0] - mean_x) ** 2 for x, _ in self._samples)
        if sxx <= 0.0:
            return math.inf
        a, b = coef
        var = 0.0
        for x, y in self._samples:
            dx = x[0] - mean_x
            lever = 1.0 / n + dx * dx / sxx
            if lever >= 1.0 - 1e-9:
                return math.inf
            e = (y - a - b * x[0]) / (1.0 - lever)
            var += dx * dx * e * e
        return math.sqrt(var) / sxx


def prefill_features(r: ForwardPassMetrics) -> tuple[float, ...]:
    return (float(r.scheduled_requests.sum_prefill_tokens),)


def decode_features(r: ForwardPassMetrics) -> tuple[float, ...]:
    s = r.scheduled_requests
    return (float(s.num_decode_requests), float(s.sum_decode_kv_tokens))


class LatencyModels:
    """The two pools' regressions, fed by the observer, snapshotted (as fits) for the policy."""

    def __init__(self, window: int = 512) -> None:
        self.prefill = WindowedRegression(1, window)
        self.decode = WindowedRegression(2, window)

    def add(self, pool: str, record: ForwardPassMetrics) -> None:
        if record.wall_time <= 0.0:
            return  # heartbeats and queue snapshots are not timing samples
        if pool == "prefill":
            if record.scheduled_requests.sum_prefill_tokens > 0:
                self.prefill.add(prefill_features(record), record.wall_time)
        elif record.scheduled_requests.num_decode_requests > 0:
            self.decode.add(decode_features(record), record.wall_time)

    def fits(self) -> tuple[LinearFit | None, LinearFit | None]:
        return self.prefill.fit(), self.decode.fit()
