"""The ``simulate --report`` writer: three files, a self-contained HTML page with the chart embedded as a PNG,
the actions table escaped, and no crash on the thin results (no ticks, no requests, a static run)."""

from __future__ import annotations

import base64
import html
import json
import math
import random
import re
import struct
from pathlib import Path
from typing import Any

from dynamo.planner.sim.report import _attainment, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REASONS = [
    "decode ITL 41 ms > SLA 30 ms & KV queue <growing>",
    "prefill TTFT p90 < 0.5 * SLA for 3 ticks",
    'idle: "queue" empty',
]


def synthetic_result(
    n_ticks: int = 60, n_requests: int = 400, tick_s: float = 5.0, seed: int = 7
) -> dict[str, Any]:
    """A planner run shaped like the harness's: a burst in the middle, decode scales up then back down."""
    rng = random.Random(seed)
    duration = n_ticks * tick_s
    ticks = []
    for i in range(n_ticks):
        t = i * tick_s
        burst = duration / 3 <= t < 2 * duration / 3
        ticks.append(
            {
                "t_s": t,
                "prefill": {
                    "active": 1,
                    "starting": 0,
                    "draining": 0,
                    "desired": 1,
                    "queued_prefill_tokens": rng.randint(0, 30_000 if burst else 2_000),
                    "queued_decode_kv_tokens": 0,
                },
                "decode": {
                    "active": 3 if burst else 1,
                    "starting": 1 if burst and i % 4 == 0 else 0,
                    "draining": 1 if not burst and i % 7 == 0 else 0,
                    "desired": 3 if burst else 1,
                    "queued_prefill_tokens": 0,
                    "queued_decode_kv_tokens": rng.randint(0, 400_000 if burst else 20_000),
                },
            }
        )
    actions = [
        {"t_s": duration / 3, "pool": "decode", "from": 1, "to": 3, "reason": REASONS[0]},
        {"t_s": duration / 3 + tick_s, "pool": "prefill", "from": 1, "to": 2, "reason": REASONS[1]},
        {"t_s": 2 * duration / 3, "pool": "decode", "from": 3, "to": 1, "reason": REASONS[2]},
    ]
    requests: list[dict[str, Any]] = []
    for _ in range(n_requests):
        arrival = rng.uniform(0, duration)
        done = rng.random() > 0.03
        ttft = rng.uniform(50, 900) if done else None
        itl = rng.uniform(5, 45) if done else None
        ok = bool(done and ttft is not None and itl is not None and ttft <= 500 and itl <= 30)
        requests.append({"arrival_s": arrival, "ttft_ms": ttft, "itl_ms": itl, "ok": ok})
    good = sum(r["ok"] for r in requests)
    summary = {
        "requests": n_requests,
        "completed_requests": sum(r["ttft_ms"] is not None for r in requests),
        "goodput_requests": good,
        "goodput_pct": 100.0 * good / max(1, n_requests),
        "gpu_hours": 0.42,
        "p50_ttft_ms": 310.0,
        "p90_ttft_ms": 620.0,
        "p99_ttft_ms": 880.0,
        "p50_itl_ms": 19.0,
        "p90_itl_ms": 33.0,
        "p99_itl_ms": 44.0,
        "scaling_actions": len(actions),
        "direction_flips": 1,
        "mode": "planner",
        "static": None,
        "startup_time_s": 60.0,
        "sla_ttft_ms": 500.0,
        "sla_itl_ms": 30.0,
        "duration_s": duration,
        "planner_wall_s": 0.8,
        "simulator_wall_s": 3.1,
        "scenario": "burst <decode-heavy>",
    }
    return {"summary": summary, "ticks": ticks, "actions": actions, "requests": requests}


def _png_from(page: str) -> bytes:
    found = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(found) == 1, "exactly one embedded chart expected"
    return base64.b64decode(found[0], validate=True)


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == PNG_SIGNATURE
    assert png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    return int(width), int(height)


def _assert_self_contained(page: str) -> None:
    lowered = page.lower()
    assert "http://" not in lowered and "https://" not in lowered
    assert "<script src" not in lowered and "<link" not in lowered


def test_planner_run_report(tmp_path: Path) -> None:
    result = synthetic_result()
    out = tmp_path / "report"
    path = write_report(result, out)

    assert path == out / "report.html"
    for name in ("report.html", "summary.json", "timeline.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "summary.json").read_text()) == result["summary"]
    assert json.loads((out / "timeline.json").read_text()) == result

    page = path.read_text(encoding="utf-8")
    _assert_self_contained(page)
    png = _png_from(page)
    width, height = _png_size(png)
    assert 800 <= width <= 3000 and 600 <= height <= 3000
    assert 10_000 < len(png) < 3_000_000

    for reason in REASONS:
        assert html.escape(reason, quote=True) in page, reason
        assert reason not in page or reason == html.escape(reason, quote=True)
    assert "&lt;decode-heavy&gt;" in page  # the extra summary field, escaped too
    assert "no scaling actions" not in page
    assert f"{result['summary']['goodput_pct']:.1f} %" in page


def test_empty_and_static_results_still_report(tmp_path: Path) -> None:
    empty: dict[str, Any] = {"summary": {"mode": "planner"}, "ticks": [], "actions": [], "requests": []}
    page = write_report(empty, tmp_path / "empty").read_text(encoding="utf-8")
    _assert_self_contained(page)
    _png_size(_png_from(page))
    assert "no scaling actions" in page

    static = synthetic_result(n_ticks=20, n_requests=50)
    static["actions"] = []
    static["summary"].update(mode="static", static=[2, 3], scaling_actions=0, direction_flips=0)
    for tick in static["ticks"]:
        for pool in ("prefill", "decode"):
            tick[pool].update(starting=0, draining=0, desired=tick[pool]["active"])
    for r in static["requests"][::5]:  # some never completed
        r.update(ttft_ms=None, itl_ms=None, ok=False)
    page = write_report(static, tmp_path / "static").read_text(encoding="utf-8")
    _png_size(_png_from(page))
    assert "no scaling actions" in page
    assert "static, 2 prefill + 3 decode" in page


def test_attainment_bins_by_arrival() -> None:
    """A request counts in the bin it arrived in, whatever its latency; empty bins are gaps, not 0 %."""
    requests: list[dict[str, Any]] = [
        {"arrival_s": 1.0, "ttft_ms": 100.0, "itl_ms": 10.0, "ok": True},
        {"arrival_s": 9.9, "ttft_ms": None, "itl_ms": None, "ok": False},
        {"arrival_s": 25.0, "ttft_ms": 90_000.0, "itl_ms": 10.0, "ok": True},
    ]
    edges, counts, pct = _attainment(requests, t_end=30.0)
    assert edges.tolist() == [0.0, 10.0, 20.0, 30.0]
    assert counts.tolist() == [2.0, 0.0, 1.0]
    assert pct[0] == 50.0 and math.isnan(pct[1]) and pct[2] == 100.0
