"""The worker keeps its own file-discovery entries fresh and present, and touches nothing else."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from dynamo.vllm.runtime_workarounds import file_discovery_keepalive as ka

WORKER = 7417832320737632204  # its entries end in %2F66f16f31c0fa5fcc
OTHER = 7625979231528302991


def _entry(root: Path, bucket: str, connection_id: int, age_s: float) -> Path:
    path = root / "v1" / bucket / f"demo%2Fbackend%2Fgenerate{ka.owned_suffix(connection_id)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_suffix_is_the_runtimes_file_name_for_a_connection() -> None:
    assert ka.owned_suffix(WORKER) == "%2F66f16f31c0fa5fcc"


def test_only_this_workers_files_are_touched(tmp_path: Path) -> None:
    mine = [_entry(tmp_path, "instances", WORKER, 9), _entry(tmp_path, "mdc", WORKER, 9)]
    theirs = _entry(tmp_path, "mdc", OTHER, 9)
    temp = tmp_path / "v1" / "mdc" / f".tmp_x{ka.owned_suffix(WORKER)}"
    temp.write_text("")
    os.utime(temp, (1, 1))
    assert sorted(ka.touch_owned_files(tmp_path, WORKER)) == sorted(mine)
    assert all(time.time() - p.stat().st_mtime < 2 for p in mine)
    assert time.time() - theirs.stat().st_mtime > 8
    assert temp.stat().st_mtime == 1  # the runtime's temporary files are not entries


def test_touching_never_creates_an_entry(tmp_path: Path) -> None:
    gone = _entry(tmp_path, "mdc", WORKER, 0)
    gone.unlink()
    assert ka.touch_owned_files(tmp_path, WORKER) == []
    assert not gone.exists()
    assert ka.touch_owned_files(tmp_path / "no-such-folder", WORKER) == []


def test_an_entry_deleted_by_another_process_is_written_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mdc = _entry(tmp_path, "mdc", WORKER, 0)
    mdc.write_text('{"card": 1}')
    theirs = _entry(tmp_path, "mdc", OTHER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER)
    keeper.run_once()
    mdc.unlink()  # what another process's expiry does
    theirs.unlink()
    with caplog.at_level(logging.WARNING):
        keeper.run_once()
    assert mdc.read_text() == '{"card": 1}'
    assert keeper.restored == 1
    assert not theirs.exists()  # only ever our own entries
    assert "deleted by another process" in caplog.text
    assert not [p for p in mdc.parent.iterdir() if p.name.startswith(ka.TEMP_PREFIX)]


def test_restoring_never_overwrites_a_newer_entry(tmp_path: Path) -> None:
    path = tmp_path / "entry"
    path.write_text("new")
    assert ka.restore_entry(path, b"old") is False
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_nothing_is_written_back_once_stopped(tmp_path: Path) -> None:
    entry = _entry(tmp_path, "instances", WORKER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=0.05).start()
    deadline = time.monotonic() + 5
    while not keeper._content and time.monotonic() < deadline:
        time.sleep(0.02)
    keeper.stop()  # the worker stops the keep-alive before it unregisters
    entry.unlink()
    time.sleep(0.2)
    keeper.run_once()  # also a pass already under way when stop() came
    assert not entry.exists()
    assert keeper.restored == 0


def test_a_late_pass_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ka, "LATE_WARNING_S", 0.0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=0.05)
    with caplog.at_level(logging.WARNING):
        keeper.start()
        time.sleep(0.3)
        keeper.stop()
    assert "this process is starved" in caplog.text


def test_the_thread_keeps_an_entry_younger_than_the_runtimes_expiry(tmp_path: Path) -> None:
    entry = _entry(tmp_path, "mdc", WORKER, 9.5)  # 0.5 s before the runtime would delete it
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while time.time() - entry.stat().st_mtime > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.time() - entry.stat().st_mtime < 1
    finally:
        keeper.stop()
    os.utime(entry, (1, 1))
    time.sleep(0.2)
    assert entry.stat().st_mtime == 1  # stopped: nothing touches it any more


def test_started_only_for_file_discovery_with_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    assert ka.start_for_worker("etcd", WORKER) is None
    keeper = ka.start_for_worker("file", WORKER)
    assert keeper is not None and keeper.root == tmp_path
    keeper.stop()
    monkeypatch.delenv("DYN_FILE_KV")
    assert ka.start_for_worker("file", WORKER) is None
    with pytest.raises(ValueError):
        ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=0)
