"""Traces in the Azure LLM inference format, replayed as the shipped Azure workloads are."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dynamo.planner.sim.azure import azure_rows
from dynamo.planner.sim.azure_csv import is_azure_csv, read_azure_csv, write_mooncake
from dynamo.planner.sim.inputs import SimInputError, check_trace
from dynamo.planner.sim.workloads import workload_requests

START = datetime(2023, 11, 16, 18, 17, 3, tzinfo=UTC)


def _stamp(offset_us: int, tail: str = "0") -> str:
    """Azure's 7 fractional digits: microseconds and one more."""
    t = START + timedelta(microseconds=offset_us)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f") + tail


def _csv(
    path: Path, rows: list[tuple[str, int, int]], header: str = "TIMESTAMP,ContextTokens,GeneratedTokens"
) -> Path:
    path.write_text(header + "\n" + "".join(f"{t},{i},{o}\n" for t, i, o in rows))
    return path


def test_the_published_hour_converts_to_the_shipped_workload(tmp_path: Path) -> None:
    """The coding trace's first 400 requests written back in Azure's format convert to the shipped trace's
    rows, and to the `azure-code-x1` workload's requests (the same modelled prefix sharing)."""
    shipped = azure_rows("code")[:400]
    f = _csv(tmp_path / "code.csv", [(_stamp(int(t * 1000)), i, o) for t, i, o in shipped])
    assert is_azure_csv(f)
    trace = read_azure_csv(f)
    assert trace.rows == list(shipped) and trace.skipped == 0
    out = write_mooncake(trace, tmp_path / "code.jsonl", share=0.5, seed=0)
    check_trace(str(out))
    mine = [json.loads(line) for line in out.read_text().splitlines()]
    assert mine == workload_requests("azure-code-x1", 0, 0.5)[:400]


def test_rows_are_sorted_to_whole_milliseconds_and_empty_requests_counted(tmp_path: Path) -> None:
    f = _csv(
        tmp_path / "t.csv",
        [
            (_stamp(2_500_000), 100, 5),  # 2.5 s after the first: out of order in the file
            (_stamp(0), 300, 7),
            (_stamp(1_000_499, "9"), 200, 3),  # 1000.4999 ms -> 1000 ms
            (_stamp(1_500_500), 50, 0),  # no output tokens: a failed request, left out
        ],
    )
    trace = read_azure_csv(f)
    assert trace.rows == [(0.0, 300, 7), (1000.0, 200, 3), (2500.0, 100, 5)] and trace.skipped == 1
    # A header with spaces after its commas is an Azure header to the detection and to the reader alike.
    spaced = _csv(
        tmp_path / "s.csv", [(_stamp(0), 300, 7)], header="TIMESTAMP, ContextTokens, GeneratedTokens"
    )
    assert is_azure_csv(spaced) and read_azure_csv(spaced).rows == [(0.0, 300, 7)]


def test_the_modelled_share_continues_earlier_requests(tmp_path: Path) -> None:
    f = _csv(tmp_path / "t.csv", [(_stamp(k * 100_000), 640, 10) for k in range(50)])
    trace = read_azure_csv(f)

    def shared(share: float) -> int:
        out = write_mooncake(trace, tmp_path / f"s{share}.jsonl", share=share, seed=3)
        ids = [json.loads(line)["hash_ids"] for line in out.read_text().splitlines()]
        return sum(1 for i, h in enumerate(ids) if any(h[0] == e[0] for e in ids[:i]))

    assert shared(0.0) == 0 and shared(1.0) == 49


@pytest.mark.parametrize(
    ("header", "line", "message"),
    [
        ("TIMESTAMP,ContextTokens", "2023-11-16 18:17:03.0000000,10", "no column GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.0000000,ten,2", "line 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens", "yesterday,10,2", "line 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.0000000,0,2", "no requests"),
    ],
)
def test_a_bad_file_is_named_with_its_line(tmp_path: Path, header: str, line: str, message: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(f"{header}\n{line}\n")
    with pytest.raises(SimInputError, match=message):
        read_azure_csv(f)
    with pytest.raises(SimInputError, match="no such file"):
        read_azure_csv(tmp_path / "none.csv")
    assert not is_azure_csv(tmp_path / "none.csv")
    with pytest.raises(SimInputError, match="prefix-share"):
        write_mooncake(read_azure_csv(_csv(tmp_path / "ok.csv", [(_stamp(0), 10, 2)])), tmp_path / "o", 1.5)
