"""Drive a phased load through the frontend's OpenAI completions API and time every request.

Closed loop: in each phase ``concurrency`` clients send streaming completions back to back until the
phase ends. TTFT is the time to the first streamed token, ITL the gaps between later tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "this",
    "for",
    "with",
    "as",
    "at",
    "on",
    "are",
    "was",
    "be",
    "or",
    "an",
]


@dataclass(frozen=True)
class Phase:
    """A load phase: ``concurrency`` 0 means idle (no requests)."""

    name: str
    duration_s: float
    concurrency: int = 0
    prompt_words: int = 8
    max_tokens: int = 16


@dataclass
class RequestResult:
    phase: str
    start: float  # epoch seconds
    ok: bool
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str = ""
    cancelled: bool = False  # still running when its phase ended (cut off on purpose, not a failure)


@dataclass
class LoadState:
    """What the live view shows while the load runs."""

    phase: str = ""
    phase_index: int = 0
    phase_started: float = 0.0
    started: float = 0.0
    total_s: float = 0.0
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    last_error: str = ""
    results: list[RequestResult] = field(default_factory=list)
    phase_times: list[tuple[str, float, float]] = field(default_factory=list)  # name, start, end (epoch)
    last_token_at: float = 0.0  # epoch seconds of the latest streamed token of any request

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds without any streamed token while requests are in flight (0 when none are)."""
        if not self.in_flight:
            return 0.0
        now = now or time.time()
        return now - max(self.last_token_at, self.phase_started)

    def progress(self, now: float | None = None) -> float:
        if not self.total_s or not self.started:
            return 0.0
        return min(1.0, ((now or time.time()) - self.started) / self.total_s)


def make_prompt(n_words: int, seed: int) -> str:
    """A deterministic prompt of ``n_words`` common words (all in the tiny model's vocabulary)."""
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(max(1, n_words)))


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, object]:
    """Greedy, streaming, and EOS ignored so every request really generates ``max_tokens``."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, object],
    phase: str,
    res: RequestResult | None = None,
    state: LoadState | None = None,
) -> RequestResult:
    """One streaming request; never raises except CancelledError (errors are recorded in ``res``)."""
    res = res or RequestResult(phase=phase, start=time.time(), ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                choices = chunk.get("choices") or []
                piece = choices[0].get("text") if choices else None
                if piece is None or (piece == "" and choices[0].get("finish_reason")):
                    continue  # not a token (a final or bookkeeping frame)
                now = time.perf_counter()
                if state is not None:
                    state.last_token_at = time.time()
                res.tokens += 1
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
        res.ok = res.error == "" and res.tokens > 0
        if not res.ok and not res.error:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        res.cancelled = True
        res.ok = res.tokens > 0
        raise
    finally:
        res.end = time.time()
    return res


# A loopback connect to the frontend took over 10 s once in a full demo on 2 cores (16 streams, two engines,
# the planner and this process all busy): 1 of 107 burst requests failed on the old 10 s limit.
CONNECT_TIMEOUT_S = 30.0


async def run_load(
    base_url: str,
    model: str,
    phases: list[Phase],
    state: LoadState | None = None,
    on_phase: Callable[[Phase], None] | None = None,
    request_timeout_s: float = 300.0,
) -> LoadState:
    """Run the phases in order; returns the state with every request's result."""
    state = state or LoadState()
    state.total_s = sum(p.duration_s for p in phases)
    state.started = time.time()
    limits = httpx.Limits(max_connections=max([p.concurrency for p in phases] + [1]) + 4)
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    seq = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for index, phase in enumerate(phases):
            state.phase, state.phase_index, state.phase_started = phase.name, index, time.time()
            if on_phase:
                on_phase(phase)
            end = time.monotonic() + phase.duration_s

            async def client_loop(slot: int, phase: Phase = phase, end: float = end) -> None:
                nonlocal seq
                while time.monotonic() < end:
                    seq += 1
                    body = completion_body(
                        model, make_prompt(phase.prompt_words, seq + slot), phase.max_tokens
                    )
                    result = RequestResult(phase=phase.name, start=time.time(), ok=False)
                    state.in_flight += 1
                    try:
                        await stream_completion(client, base_url, body, phase.name, result, state)
                    except asyncio.CancelledError:
                        state.results.append(result)  # cut off at the phase's end: keep its timings
                        raise
                    finally:
                        state.in_flight -= 1
                    state.results.append(result)
                    state.done += 1
                    if not result.ok:
                        state.failed += 1
                        state.last_error = result.error
                        await asyncio.sleep(0.5)  # don't spin on a failing server

            tasks = [asyncio.create_task(client_loop(i)) for i in range(phase.concurrency)]
            remaining = end - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
            # The phase ends on time: requests still running are cancelled (the client disconnects,
            # Dynamo cancels them in the workers), so the next phase starts from its own load.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.phase_times.append((phase.name, state.phase_started, time.time()))
    state.phase = "done"
    return state


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[rank]


def latency_summary(results: list[RequestResult]) -> dict[str, dict[str, float | int | None]]:
    """TTFT and ITL percentiles (seconds) per phase and overall."""
    out: dict[str, dict[str, float | int | None]] = {}
    phases = sorted({r.phase for r in results})
    for name in [*phases, "all"]:
        rs = [r for r in results if r.ok and (name == "all" or r.phase == name)]
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        # ITL per request (first to last token / gaps): streamed tokens often arrive several per read,
        # so single gaps are mostly 0 and say little; a request's mean is what its user sees.
        itl = [sum(r.itl_s) / len(r.itl_s) for r in rs if r.itl_s]
        failed = sum(
            1 for r in results if not r.ok and not r.cancelled and (name == "all" or r.phase == name)
        )
        out[name] = {
            "requests": len(rs),
            "failed": failed,
            "cancelled": sum(1 for r in results if r.cancelled and (name == "all" or r.phase == name)),
            "tokens": sum(r.tokens for r in rs),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90),
            "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50),
            "itl_p90": percentile(itl, 90),
            "itl_p99": percentile(itl, 99),
        }
    return out
