"""The arrival source's edge cases on Prometheus text (the real frontend: tests/e2e/test_worker_e2e.py)."""

from __future__ import annotations

import pytest
from dynamo.planner.arrivals import FrontendArrivals, parse_counters
from dynamo.planner.config import ConfigError
from dynamo.planner.sim.traffic import arrivals_from
from dynamo_fpm_testing.planner_support import config


def frontend_text(
    started: float,
    isl_sum: float,
    isl_count: float,
    model: str = "m",
    *,
    started_name: str = "requests_started_total",
) -> str:
    """What a frontend's /metrics shows for one model (the families the source reads, and one it does not)."""
    return f"""# HELP dynamo_frontend_{started_name.removesuffix("_total")} Requests admitted
# TYPE dynamo_frontend_{started_name.removesuffix("_total")} counter
dynamo_frontend_{started_name}{{model="{model}",endpoint="completions"}} {started}
# HELP dynamo_frontend_input_sequence_tokens Prompt tokens
# TYPE dynamo_frontend_input_sequence_tokens histogram
dynamo_frontend_input_sequence_tokens_bucket{{model="{model}",le="+Inf"}} {isl_count}
dynamo_frontend_input_sequence_tokens_sum{{model="{model}"}} {isl_sum}
dynamo_frontend_input_sequence_tokens_count{{model="{model}"}} {isl_count}
# HELP dynamo_frontend_inflight_requests In flight
# TYPE dynamo_frontend_inflight_requests gauge
dynamo_frontend_inflight_requests{{model="{model}"}} 3
"""


class Scrapes:
    """A fetch that returns the queued texts per URL (an exception is raised)."""

    def __init__(self, **texts: list[str | Exception]) -> None:
        self.texts = {f"http://{k}/metrics": list(v) for k, v in texts.items()}

    def __call__(self, url: str, timeout_s: float) -> str:
        item = self.texts[url].pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def source(fetch: Scrapes, model: str | None = None) -> FrontendArrivals:
    return FrontendArrivals(list(fetch.texts), model=model, fetch=fetch)


def test_counters_sum_every_series_of_the_model_and_fall_back_to_completed_requests() -> None:
    two = (
        frontend_text(10, 5000, 5, "a")
        + frontend_text(4, 800, 4, "b").split("# HELP dynamo_frontend_input")[0]
    )
    assert parse_counters(two).requests == 14
    assert parse_counters(two, model="b").requests == 4
    old = frontend_text(7, 700, 7, started_name="requests_total")
    assert parse_counters(old).requests == 7
    # A fresh frontend has no request series yet: zero requests, for any model.
    assert parse_counters("# TYPE x counter\nx_total 1\n", model="c").requests == 0
    with pytest.raises(ValueError, match="for model 'c' \\(models seen: a, b\\)"):
        parse_counters(two, model="c")


async def test_rates_over_each_frontends_own_interval_summed() -> None:
    fetch = Scrapes(
        f1=[
            frontend_text(100, 100_000, 100),
            frontend_text(150, 150_000, 150),
            frontend_text(150, 150_000, 150),
        ],
        f2=[frontend_text(0, 0, 0), frontend_text(25, 50_000, 25), frontend_text(5, 10_000, 5)],
    )
    src = source(fetch)
    assert await src.read(0.0) is None  # baselines
    a = await src.read(5.0)
    assert a is not None
    assert (a.requests_per_s, a.mean_isl, a.window_s) == (15.0, 100_000 / 75, 5.0)
    # f2 restarted (its counters went down): they count from 0, as Prometheus' increase() does.
    b = await src.read(10.0)
    assert b is not None and b.requests_per_s == 1.0 and b.mean_isl == 2000.0


async def test_a_failed_scrape_is_an_error_never_a_partial_sum() -> None:
    fetch = Scrapes(
        f1=[frontend_text(0, 0, 0), frontend_text(50, 50_000, 50)],
        f2=[frontend_text(0, 0, 0), OSError("refused")],
    )
    src = source(fetch)
    assert await src.read(0.0) is None
    with pytest.raises(OSError, match="refused"):
        await src.read(5.0)
    bad = Scrapes(f1=["garbage that is not a metric line {"])
    with pytest.raises(ValueError, match="http://f1/metrics"):
        await source(bad).read(0.0)


async def test_an_interval_without_requests_keeps_the_last_mean_prompt() -> None:
    fetch = Scrapes(f1=[frontend_text(0, 0, 0), frontend_text(10, 20_000, 10), frontend_text(10, 20_000, 10)])
    src = source(fetch)
    await src.read(0.0)
    assert (await src.read(5.0)) is not None
    quiet = await src.read(10.0)
    assert quiet is not None and (quiet.requests_per_s, quiet.mean_isl) == (0.0, 2000.0)


def test_the_simulators_traffic_is_the_same_reading() -> None:
    a = arrivals_from({"duration_s": 5.0, "num_req": 30, "avg_isl": 1800.0, "avg_osl": 900.0})
    assert a is not None and (a.requests_per_s, a.mean_isl, a.window_s, a.prompt_tokens_per_s) == (
        6.0,
        1800.0,
        5.0,
        10_800.0,
    )
    assert arrivals_from({"duration_s": 5.0, "num_req": 0, "avg_isl": None}) == arrivals_from(
        {"duration_s": 5.0}
    )
    assert arrivals_from(None) is None and arrivals_from({"duration_s": 0, "num_req": 3}) is None


def test_frontend_urls_are_checked_and_split() -> None:
    cfg = config(frontend_metrics_url="http://a:8000/metrics, http://b:8000/metrics,")
    assert cfg.frontend_urls() == ("http://a:8000/metrics", "http://b:8000/metrics")
    assert config().frontend_urls() == ()
    with pytest.raises(ConfigError, match="frontend_metrics_url: 'a:8000/metrics' is not an http"):
        config(frontend_metrics_url="a:8000/metrics")
    with pytest.raises(ValueError, match="at least one URL"):
        FrontendArrivals([])
