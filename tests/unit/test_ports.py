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


def test_low_free_port_is_stable_and_below_32768() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.low_free_port()
        assert port <= ports.SIGNED_16_BIT_MAX - ports.HEADROOM
        assert not low <= port <= high + ports.HEADROOM


def test_a_cap_with_no_room_outside_the_ephemeral_range_fails_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 40000))
    with pytest.raises(RuntimeError, match="below 32768 outside the ephemeral range 1024-40000"):
        ports.low_free_port()


def test_free_port_is_the_kernels_choice_and_free() -> None:
    low, high = ports.ephemeral_range()
    port = ports.free_port()
    assert low <= port <= high
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_local_connector_gives_workers_ports_outside_the_ephemeral_range(tmp_path: Path) -> None:
    """A worker binds its ``{port}`` after loading its model: a kernel-chosen one could be taken by then."""
    import asyncio
    import time

    from dynamo.planner.connector_local import LocalConnector

    async def spawn_one() -> str:
        c = LocalConnector(
            prefill_command="python -c 'print(\"port\", {port}, flush=True)'",
            decode_command="python -c pass",
            log_dir=tmp_path,
        )
        await c.start()
        try:
            await c.apply(1, 0)
            deadline = time.monotonic() + 30
            log = tmp_path / "prefill-0.log"
            while "port" not in (log.read_text() if log.exists() else ""):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            return log.read_text()
        finally:
            await c.close()

    port = int(asyncio.run(spawn_one()).split("port", 1)[1].split()[0])
    low, high = ports.ephemeral_range()
    assert not low <= port <= high + ports.HEADROOM
