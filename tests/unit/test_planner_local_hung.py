"""When the ``local`` connector counts a live worker process as hung (``local_hung``, pure)."""

from __future__ import annotations

import pytest
from dynamo.planner.local_hung import HungCheck, check_stopped, stat_state


@pytest.mark.parametrize(
    ("line", "state"),
    [
        ("1234 (python) S 1 1234 1234 0 -1", "S"),
        ("1234 (python -m dynamo.vllm) T 1 1234", "T"),
        ("77 (a) b) (c) t 1 77", "t"),  # the name holds parentheses and spaces: the last ``)`` counts
        ("", None),
        ("1234 (python)", None),
    ],
)
def test_stat_state_reads_the_letter_after_the_name(line: str, state: str | None) -> None:
    assert stat_state(line) == state


def test_a_stopped_worker_is_hung_once_seen_stopped_for_the_bound() -> None:
    first = check_stopped("T", None, now=100.0, hung_after_s=30)
    assert first == HungCheck(100.0, None)
    assert check_stopped("T", first.stopped_since, now=129.9, hung_after_s=30) == HungCheck(100.0, None)
    hung = check_stopped("T", first.stopped_since, now=131.0, hung_after_s=30)
    assert hung.stopped_since == 100.0
    assert hung.reason == "stopped by a signal (state T) for 31 s (local.hung_after_s 30)"
    traced = check_stopped("t", 100.0, now=140.0, hung_after_s=30)
    assert traced.reason is not None and traced.reason.startswith("stopped by a tracer (state t)")


@pytest.mark.parametrize("state", ["R", "S", "D", "Z", None])
def test_a_running_or_unknown_worker_restarts_the_clock(state: str | None) -> None:
    assert check_stopped(state, 100.0, now=500.0, hung_after_s=30) == HungCheck(None, None)


def test_zero_turns_the_check_off() -> None:
    assert check_stopped("T", 0.0, now=1e6, hung_after_s=0) == HungCheck(None, None)
