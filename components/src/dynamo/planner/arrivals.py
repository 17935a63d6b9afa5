"""Where the planner learns the arrival rate: the frontend's request and prompt-token counters.

The FPM records say what each engine holds and queues, not how much work arrives: an unsaturated
prefill engine clears its queue every pass and reads load 0 whether it is 5% or 95% busy. The frontend
counts every request it admits and the prompt tokens they carry; the rate of those counters over an
interval is the pool's arrival rate. A source is optional: without one the policy decides on the
records alone (docs/planner.md, "Arrivals").
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from .observations import Arrivals


class ArrivalSource(Protocol):
    """Reads the arrivals over the interval that ended at ``now`` (None: not known this time)."""

    async def read(self, now: float) -> Arrivals | None: ...


FRONTEND_PREFIX = "dynamo_frontend"  # ``dynamo.prometheus_names.name_prefix.FRONTEND`` in the runtime
STARTED = "requests_started_total"  # counted as a request is admitted: the offered load
COMPLETED = "requests_total"  # counted as it ends: frontends that lack the started counter
ISL = "input_sequence_tokens"  # histogram of prompt lengths (its _sum and _count)


@dataclass(frozen=True, slots=True)
class Counters:
    """One frontend's cumulative counters at one scrape."""

    requests: float
    isl_sum: float
    isl_count: float


def parse_counters(text: str, model: str | None = None, prefix: str = FRONTEND_PREFIX) -> Counters:
    """The request and prompt-token counters in a frontend's Prometheus text, summed over their series
    (only ``model``'s when given).

    A frontend creates a model's series at its first request: none at all reads as zero requests. A
    ``model`` absent while other models have request counters is a misconfiguration: ``ValueError``.
    """
    started = completed = isl_sum = isl_count = 0.0
    seen_started = False
    models: set[str] = set()
    requests = (f"{prefix}_{STARTED}", f"{prefix}_{COMPLETED}")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in requests:
                models.add(s.labels.get("model", ""))
            if model is not None and s.labels.get("model") != model:
                continue
            if s.name == requests[0]:
                started, seen_started = started + s.value, True
            elif s.name == requests[1]:
                completed += s.value
            elif s.name == f"{prefix}_{ISL}_sum":
                isl_sum += s.value
            elif s.name == f"{prefix}_{ISL}_count":
                isl_count += s.value
    if model is not None and models and model not in models:
        seen = ", ".join(sorted(models))
        raise ValueError(f"no {requests[0]} series for model {model!r} (models seen: {seen})")
    return Counters(started if seen_started else completed, isl_sum, isl_count)


def _increase(now: float, before: float) -> float:
    """A counter's increase; a counter that went down was reset (a restart) and counts from 0."""
    return now if now < before else now - before


class FrontendArrivals:
    """Arrivals from the frontends' ``/metrics``: the rate of their counters between two scrapes.

    Every frontend replica counts only the requests it admitted, so list each one (a Service that
    balances over replicas would read one at random). A scrape that fails raises: the planner logs it
    and decides without arrivals that tick, never on a partial sum (it would read low and free
    replicas). The first scrape of each URL only sets its baseline.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        timeout_s: float = 2.0,
        fetch: Callable[[str, float], str] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("FrontendArrivals needs at least one URL")
        self.urls = tuple(urls)
        self.model = model
        self.timeout_s = timeout_s
        self._fetch = fetch or _http_get
        self._last: dict[str, tuple[float, Counters]] = {}
        self._isl = 0.0  # the last mean prompt length seen (an interval may complete no request)

    async def read(self, now: float) -> Arrivals | None:
        texts = await asyncio.gather(*(asyncio.to_thread(self._fetch, u, self.timeout_s) for u in self.urls))
        rate = tokens = count = 0.0
        window = 0.0
        fresh = True
        for url, text in zip(self.urls, texts, strict=True):
            try:
                cur = parse_counters(text, self.model)
            except ValueError as exc:
                raise ValueError(f"{url}: {exc}") from None
            prev = self._last.get(url)
            self._last[url] = (now, cur)
            if prev is None or now <= prev[0]:
                fresh = False
                continue
            dt = now - prev[0]
            rate += _increase(cur.requests, prev[1].requests) / dt
            tokens += _increase(cur.isl_sum, prev[1].isl_sum)
            count += _increase(cur.isl_count, prev[1].isl_count)
            window = max(window, dt)
        if not fresh:
            return None
        if count > 0:
            self._isl = tokens / count
        return Arrivals(rate, self._isl, window)


def _http_get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", errors="replace")
