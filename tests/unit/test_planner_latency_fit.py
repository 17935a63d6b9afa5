"""The pass-time regressions (``sla_model``): exact coefficients, their standard errors, and when a
slope is known well enough to price a prompt token."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from dynamo.planner.observations import Arrivals
from dynamo.planner.policy import PoolState, PoolView, arrival_engines
from dynamo.planner.sla_model import LinearFit, WindowedRegression
from dynamo_fpm_testing.planner_support import config, pool, rec


def _hc3_slope_stderr(xs: list[float], ys: list[float]) -> tuple[np.ndarray, float]:
    """Ordinary least squares and the slope's HC3 standard error, by the matrix formula."""
    x = np.column_stack([np.ones(len(xs)), np.array(xs)])
    y = np.array(ys)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    bread = np.linalg.inv(x.T @ x)
    lever = np.einsum("ij,jk,ik->i", x, bread, x)
    w = ((y - x @ coef) / (1 - lever)) ** 2
    cov = bread @ (x.T * w) @ x @ bread
    return coef, float(np.sqrt(cov[1, 1]))


def test_the_sliding_fit_matches_least_squares_and_the_hc3_slope_error() -> None:
    rng = random.Random(7)
    reg = WindowedRegression(1, window=40)
    xs, ys = [], []
    for _ in range(100):  # 60 evicted: the running sums must subtract them exactly
        x = float(rng.randint(100, 20_000))
        y = 0.004 + 2e-6 * x + rng.gauss(0, 1e-3) * (1 + x / 5_000)  # noisier on longer passes
        reg.add((x,), y)
        xs.append(x)
        ys.append(y)
    fit = reg.fit()
    assert fit is not None and fit.samples == 40
    coef, se = _hc3_slope_stderr(xs[-40:], ys[-40:])
    assert fit.coef == pytest.approx(tuple(coef), rel=1e-5, abs=1e-9)
    assert fit.slope_stderr == pytest.approx(se, rel=1e-6)
    assert fit.slope_known()
    # Models of more than one feature (decode) carry no error: their slopes are not tested.
    two = WindowedRegression(2)
    for i in range(5):
        two.add((float(i), float(i * i)), 0.01 + 0.001 * i)
    assert (f := two.fit()) is not None and f.slope_stderr is None


def test_passes_of_one_size_leave_the_slope_unknown_however_steep_it_reads() -> None:
    """A demo's equal 8-token prompts on a CPU, two passes of two prompts, one of them stalled for 0.4 s:
    the fit reads 0.02 s a token, 2.9 classical standard errors above zero -- noise, not cost. HC3 sees
    that one sample makes it; a wide spread of sizes knows the slope."""
    walls = [0.009, 0.054, 0.008, 0.054, 0.005, 0.009, 0.056, 0.069, 0.009, 0.059, 0.053, 0.007, 0.012]
    reg = WindowedRegression(1)
    for w in walls:
        reg.add((8.0,), w)
    reg.add((16.0,), 0.42)
    reg.add((16.0,), 0.012)
    fit = reg.fit()
    assert fit is not None and fit.coef[1] > 0.01
    assert fit.slope_stderr is not None and fit.coef[1] < 1.0 * fit.slope_stderr
    assert not fit.slope_known()
    one_size = WindowedRegression(1)
    for w in walls:
        one_size.add((8.0,), w)
    assert (f := one_size.fit()) is not None and not f.slope_known()

    wide = WindowedRegression(1)
    rng = random.Random(3)
    for _ in range(30):
        n = float(rng.randint(8, 2048))
        wide.add((n,), 0.01 + 2e-5 * n + rng.gauss(0, 2e-3))
    known = wide.fit()
    assert known is not None and known.slope_known()
    # A fit without an error (built by hand) knows a positive slope.
    assert LinearFit((0.01, 2e-5), 50).slope_known()
    assert not LinearFit((0.01, -2e-5), 50).slope_known()


def test_arrivals_are_not_priced_by_an_unknown_slope() -> None:
    """The prefill pool's arrival demand needs a known per-token cost: with the noisy fit above and no
    measured saturated rate it is unknown (the pool is sized by its queue), not 2 engines of nothing."""
    prefill = pool("prefill", [rec("p0", s_prefill=1, s_prefill_tokens=8)])
    view = PoolView(prefill, PoolState(), config(), 1, 60.0, arrivals=Arrivals(3.0, 8.0, 2.0))
    noisy = LinearFit((-0.15, 0.023), 15, 0.03)
    assert arrival_engines(replace(view, pool=replace(prefill, latency=noisy)), None) is None
    known = LinearFit((0.01, 2e-5), 15, 1e-6)
    assert arrival_engines(replace(view, pool=replace(prefill, latency=known)), None) is not None
