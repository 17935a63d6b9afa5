"""Ports chosen now and bound much later (vLLM's NIXL side channel) stay out of the kernel's ephemeral
range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
from dynamo.common import ports


def test_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t50000\n")
    assert ports.ephemeral_range(good) == (40000, 50000)
    bad = tmp_path / "bad"
    bad.write_text("nonsense\n")
    assert ports.ephemeral_range(bad) == ports.DEFAULT_EPHEMERAL_RANGE
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL_RANGE


def test_stable_free_port_is_free_and_never_one_the_kernel_hands_out() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.stable_free_port()
        assert not low <= port <= high + ports.HEADROOM
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free right now
    # What bind(0) returns is always inside the range: the kind of port that was stolen before.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high


class _Picks(random.Random):
    """Hands out the given ports in order (stands in for the random choice)."""

    def __init__(self, picks: list[int]) -> None:
        super().__init__(0)
        self.picks = list(picks)

    def randint(self, a: int, b: int) -> int:
        return self.picks.pop(0)


def test_a_taken_port_is_skipped() -> None:
    taken, free = ports.stable_free_port(), ports.stable_free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert ports.stable_free_port(rng=_Picks([taken, free])) == free
        with pytest.raises(RuntimeError, match="no free port"):
            ports.stable_free_port(attempts=2, rng=_Picks([taken, taken]))


def test_range_above_when_the_ephemeral_range_starts_low(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 40000))
    assert 40001 <= ports.stable_free_port() <= 65535 - ports.HEADROOM
