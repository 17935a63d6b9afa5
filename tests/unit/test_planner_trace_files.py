"""Any --trace made replayable: Azure 2024's timestamps, BurstGPT's CSV, a window, a speed-up, block sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dynamo.planner.sim.azure import azure_rows
from dynamo.planner.sim.azure_csv import read_azure_csv
from dynamo.planner.sim.burstgpt_csv import is_burstgpt_csv, read_burstgpt_csv
from dynamo.planner.sim.inputs import SimInputError
from dynamo.planner.sim.trace_files import (
    TraceOptions,
    infer_block_size,
    load_mooncake,
    prepare_trace,
    trace_kind,
)
from dynamo.planner.sim.trace_rows import TraceWindow, parse_duration, parse_window
from dynamo.planner.sim.workloads import workload_requests

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_azure_2024_timestamps_carry_an_offset_and_drop_a_whole_seconds_fraction(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "week.csv",
        AZURE_HEADER
        + "2024-05-10 00:00:00.009930+00:00,4808,10\n"
        + "2024-05-10 00:00:01+00:00,3180,8\n"  # a whole second: no fraction
        + "2024-05-10 02:00:02.5+02:00,110,27\n"  # 00:00:02.5 UTC
        + "2024-05-10T00:00:03.0099304Z,90,4\n",
    )
    assert read_azure_csv(f).rows == [(0.0, 4808, 10), (990.0, 3180, 8), (2490.0, 110, 27), (3000.0, 90, 4)]
    bad = _write(tmp_path / "bad.csv", AZURE_HEADER + "2024-05-10 00:00:00.1+0x:00,1,1\n")
    with pytest.raises(SimInputError, match="line 2: not a timestamp"):
        read_azure_csv(bad)


@pytest.mark.parametrize(
    ("text", "window"),
    [
        ("2h:1h", TraceWindow(7200.0, 3600.0)),
        ("90:30s", TraceWindow(90.0, 30.0)),
        ("1.5m:", TraceWindow(90.0, None)),
        ("1d", TraceWindow(0.0, 86400.0)),
    ],
)
def test_a_window_reads_start_and_length(text: str, window: TraceWindow) -> None:
    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["", "2x", "1h:0", "-1h:1h", "h:1h"])
def test_a_bad_window_is_refused(text: str) -> None:
    with pytest.raises(SimInputError, match="trace-window"):
        parse_window(text)
    assert parse_duration("2h", "x") == 7200.0


def test_a_window_keeps_its_requests_from_the_first_one_kept(tmp_path: Path) -> None:
    lines = "".join(f"2023-11-16 18:{m:02d}:00.0000000,{100 + m},5\n" for m in range(10))
    f = _write(tmp_path / "t.csv", AZURE_HEADER + lines)
    trace = read_azure_csv(f, parse_window("3m:2m"))  # minutes 3 and 4
    assert trace.rows == [(0.0, 103, 5), (60000.0, 104, 5)] and trace.outside == 8
    with pytest.raises(SimInputError, match="no requests in the window from 20m for 10m"):
        read_azure_csv(f, parse_window("20m:10m"))


def test_burstgpt_rows_are_seconds_from_the_start_and_failures_are_left_out(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "BurstGPT_1.csv",
        BURSTGPT_HEADER
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "45,ChatGPT,1087,0,1087,Conversation log\n"  # failed: no response
        + "7.25,GPT-4,1000,321,1321,API log\n",
    )
    assert is_burstgpt_csv(f) and trace_kind(f) == "BurstGPT"
    trace = read_burstgpt_csv(f)
    assert trace.rows == [(0.0, 472, 18), (2250.0, 1000, 321)] and trace.skipped == 1
    prepared = prepare_trace(f, tmp_path / "b.jsonl", TraceOptions(share=0.0))
    assert "BurstGPT format, 2 requests, 1 rows without prompt or output tokens left out" in prepared.note
    assert [json.loads(x)["timestamp"] for x in prepared.path.read_text().splitlines()] == [0.0, 2250.0]


def test_an_azure_csv_sped_up_is_the_shipped_x2_workload(tmp_path: Path) -> None:
    """`--trace-speedup 2` on the published coding hour makes `azure-code-x2`: arrivals halved, the sharing's
    lookback halved with them."""
    shipped = azure_rows("code")[:300]
    lines = "".join(
        f"2023-11-16 18:{17 + int(t // 60000):02d}:{(t % 60000) / 1000:010.7f},{i},{o}\n"
        for t, i, o in shipped
    )
    f = _write(tmp_path / "code.csv", AZURE_HEADER + lines)
    prepared = prepare_trace(f, tmp_path / "code-x2.jsonl", TraceOptions(speedup=2.0))
    mine = [json.loads(x) for x in prepared.path.read_text().splitlines()]
    assert mine == workload_requests("azure-code-x2", 0, 0.5)[:300]
    assert "2x faster; 0.5 of them continue an earlier one (seed 0)" in prepared.note


def _mooncake(path: Path, block: int, prompts: list[int]) -> Path:
    lines = []
    for k, isl in enumerate(prompts):
        ids = list(range(100 * k, 100 * k + -(-isl // block)))
        lines.append(
            json.dumps({"timestamp": 1000 * k, "input_length": isl, "output_length": 9, "hash_ids": ids})
        )
    return _write(path, "\n".join(lines) + "\n")


def test_a_mooncake_traces_block_size_is_read_from_its_ids(tmp_path: Path) -> None:
    assert infer_block_size(load_mooncake(_mooncake(tmp_path / "m512.jsonl", 512, [9013, 600, 2049]))) == 512
    assert infer_block_size(load_mooncake(_mooncake(tmp_path / "m64.jsonl", 64, [1280, 65, 300]))) == 64
    odd = _write(
        tmp_path / "odd.jsonl", '{"timestamp":0,"input_length":1000,"output_length":1,"hash_ids":[1,2,3]}\n'
    )
    assert infer_block_size(load_mooncake(odd)) is None  # no candidate size makes 1,000 tokens 3 ids
    prepared = prepare_trace(tmp_path / "m512.jsonl", tmp_path / "unused.jsonl")
    assert prepared.block_size == 512 and prepared.path == tmp_path / "m512.jsonl"
    assert "each hash id stands for 512 prompt tokens (read from the trace" in prepared.note
    given = prepare_trace(tmp_path / "m512.jsonl", tmp_path / "unused.jsonl", TraceOptions(block_size=1024))
    assert given.block_size == 1024 and "(given;" in given.note


def test_a_mooncake_trace_is_cut_and_sped_up_with_its_ids(tmp_path: Path) -> None:
    src = _mooncake(tmp_path / "m.jsonl", 64, [640] * 10)  # a request a second
    opts = TraceOptions(window=parse_window("2s:4s"), speedup=2.0)
    prepared = prepare_trace(src, tmp_path / "cut.jsonl", opts)
    rows = [json.loads(x) for x in prepared.path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0.0, 500.0, 1000.0, 1500.0]
    assert rows[0]["hash_ids"][0] == 200 and prepared.requests == 4
    assert "window from 2s for 4s (6 requests outside it), 2x faster" in prepared.note
    with pytest.raises(SimInputError, match="trace-speedup"):
        prepare_trace(src, tmp_path / "x.jsonl", TraceOptions(speedup=0.0))
    with pytest.raises(SimInputError, match=r"a CSV trace .* is converted with 64-token blocks"):
        prepare_trace(
            _write(tmp_path / "a.csv", AZURE_HEADER + "2023-11-16 18:00:00.0000000,10,2\n"),
            tmp_path / "y.jsonl",
            TraceOptions(block_size=512),
        )


def test_a_trace_too_long_for_every_run_is_refused_without_a_window(tmp_path: Path) -> None:
    """The traffic benchmark replays a trace in about 10 runs per router: above ``max_requests`` it asks
    for a window instead of starting hours of work; a window, even all of it (``0:``), is an answer."""
    src = _mooncake(tmp_path / "m.jsonl", 64, [640] * 10)
    csv_file = _write(
        tmp_path / "a.csv", AZURE_HEADER + "".join(f"2023-11-16 18:00:0{k}.0000000,10,2\n" for k in range(5))
    )
    for path in (src, csv_file):
        with pytest.raises(SimInputError, match=r"requests, more than 3 to replay .* --trace-window 0: all"):
            prepare_trace(path, tmp_path / "x.jsonl", TraceOptions(max_requests=3))
    whole = TraceOptions(window=parse_window("0:"))  # the benchmark asks for no limit with a window
    assert prepare_trace(src, tmp_path / "y.jsonl", whole).requests == 10
