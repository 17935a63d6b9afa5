"""The dead-peer reaper removes the file-discovery entries of an instance whose request-plane address refuses
connections (its process is gone), after enough refusals in a row, and leaves live and own entries."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from dynamo.vllm.runtime_workarounds import file_discovery_reaper as fdr


def _entry(root: Path, component: str, connection: int, port: int) -> list[Path]:
    name = f"dynamo%2F{component}%2Fgenerate%2F{connection:x}"
    paths = []
    for kind, body in (
        ("instances", {"type": "Endpoint", "transport": {"tcp": f"127.0.0.1:{port}/{connection:x}/dynamo"}}),
        ("mdc", {"type": "Model", "instance_id": connection}),
    ):
        path = root / "v1" / kind / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body))
        paths.append(path)
    return paths


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_only_the_dead_instance_is_removed_after_two_refusals(tmp_path: Path) -> None:
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        own = _entry(tmp_path, "backend", 0xA1, _closed_port())  # our own entries: never probed
        alive = _entry(tmp_path, "backend", 0xB2, live.getsockname()[1])
        dead = _entry(tmp_path, "prefill", 0xC3, _closed_port())
        (tmp_path / "v1" / "instances" / ".tmp_x").write_text("{}")  # the runtime's temporary files
        reaper = fdr.DeadPeerReaper(tmp_path, 0xA1, interval_s=1.0, refusals=2)
        assert fdr.instance_addresses(tmp_path).keys() == {"a1", "b2", "c3"}
        reaper.run_once()
        assert not any(p.exists() for p in dead) and reaper.reaped == ["c3"]
        assert all(p.exists() for p in own + alive)


def test_one_refusal_is_not_a_death(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused probe is repeated ``confirm_s`` later; an answer then keeps the entries."""
    dead = _entry(tmp_path, "prefill", 0xC3, _closed_port())
    answers = iter([True, False])  # refused, then answered (a process listening again)
    monkeypatch.setattr(fdr, "refuses", lambda host, port: next(answers))
    reaper = fdr.DeadPeerReaper(tmp_path, 0xA1, interval_s=1.0, refusals=2, confirm_s=0.01)
    reaper.run_once()
    assert all(p.exists() for p in dead) and not reaper.reaped


def test_interval_setting() -> None:
    assert fdr.interval_from({}) == fdr.DEFAULT_INTERVAL_S
    assert fdr.interval_from({fdr.ENV_INTERVAL: "0"}) == 0.0
    assert fdr.interval_from({fdr.ENV_INTERVAL: "1.5"}) == 1.5
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match=fdr.ENV_INTERVAL):
            fdr.interval_from({fdr.ENV_INTERVAL: bad})
    assert fdr.start_for_worker("etcd", 1) is None
