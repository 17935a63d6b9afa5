"""The worker keeps its own file-discovery entries fresh and present, and touches nothing else."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
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


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_an_entry_written_after_the_first_pass_is_learned_at_once_and_written_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CI failure: the runtime wrote the endpoint instance a moment after the keep-alive's first pass (the
    model card was there), and both entries were deleted before the next pass, 2 s later: the instance was
    never read, so never written back (the model card was). Now the keep-alive passes every LEARN_INTERVAL_S
    until each of the worker's folders holds a known entry, then settles at its interval."""
    mdc = _entry(tmp_path, "mdc", WORKER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=30, expect=ka.WORKER_FOLDERS).start()
    try:
        assert _wait_for(lambda: keeper.known() == [mdc])
        instance = _entry(tmp_path, "instances", WORKER, 0)  # the serving task registers it now
        assert _wait_for(lambda: instance in keeper.known(), timeout_s=2), "the instance was never read"
        assert keeper.unknown_folders() == []
        passes: list[int] = []
        touch = ka.touch_owned_files

        def counted(root: Path, connection_id: int) -> list[Path]:
            passes.append(1)
            return touch(root, connection_id)

        monkeypatch.setattr(ka, "touch_owned_files", counted)
        time.sleep(0.3)
        assert passes == []  # learned: back to the 30 s interval
        instance.unlink()  # what another process's expiry does, before the thread's next pass
        mdc.unlink()
        keeper.run_once()  # that pass
    finally:
        keeper.stop()
    assert instance.exists() and mdc.exists()
    assert keeper.restored == 2


def test_an_error_on_one_entry_does_not_stop_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = _entry(tmp_path, "instances", WORKER, 0)
    mdc = _entry(tmp_path, "mdc", WORKER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER)
    keeper.run_once()
    instance.unlink()
    mdc.unlink()
    restore = ka.restore_entry

    def failing(path: Path, content: bytes) -> bool:
        if path == instance:
            raise PermissionError(13, "Permission denied")
        return restore(path, content)

    monkeypatch.setattr(ka, "restore_entry", failing)
    with caplog.at_level(logging.WARNING):
        keeper.run_once()
    assert mdc.exists() and not instance.exists()  # instances/ sorts first: its error did not stop mdc/
    assert f"cannot write back {instance.relative_to(tmp_path)}" in caplog.text
    monkeypatch.setattr(ka, "restore_entry", restore)
    keeper.run_once()  # the next pass checks every entry again
    assert instance.exists()
    assert keeper.restored == 2


def test_a_failing_pass_does_not_end_the_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _entry(tmp_path, "mdc", WORKER, 0)
    touch = ka.touch_owned_files
    calls: list[int] = []

    def first_fails(root: Path, connection_id: int) -> list[Path]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return touch(root, connection_id)

    monkeypatch.setattr(ka, "touch_owned_files", first_fails)
    with caplog.at_level(logging.WARNING):
        keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=0.05).start()
        try:
            assert _wait_for(lambda: keeper.known() == [entry])
        finally:
            keeper.stop()
    assert "pass failed" in caplog.text


def test_each_entry_is_reported_once_and_each_pass_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    instance = _entry(tmp_path, "instances", WORKER, 0)
    mdc = _entry(tmp_path, "mdc", WORKER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, expect=ka.WORKER_FOLDERS)
    with caplog.at_level(logging.DEBUG, logger=ka.__name__):
        keeper.run_once()
        keeper.run_once()
        instance.unlink()
        keeper.run_once()
    name = str(instance.relative_to(tmp_path))
    assert caplog.text.count(ka.KEEPING_MARK) == 2
    assert f"{ka.KEEPING_MARK} {mdc.relative_to(tmp_path)} alive" in caplog.text
    assert f"1 present, missing ['{name}'], rewritten ['{name}'], no entry yet in []" in caplog.text


def test_learning_ends_after_the_runtimes_expiry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ka, "LEARN_FOR_S", 0.1)
    _entry(tmp_path, "mdc", WORKER, 0)
    keeper = ka.FileDiscoveryKeepAlive(tmp_path, WORKER, interval_s=30, expect=ka.WORKER_FOLDERS)
    with caplog.at_level(logging.WARNING):
        keeper.start()
        try:
            assert _wait_for(lambda: "no entry of this worker" in caplog.text, timeout_s=2)
        finally:
            keeper.stop()
    assert keeper.unknown_folders() == [ka.WORKER_FOLDERS[0]]
    assert "v1/instances after 0 s" in caplog.text


def test_a_worker_expects_its_instance_and_model_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    keeper = ka.start_for_worker("file", WORKER)
    assert keeper is not None
    keeper.stop()
    assert keeper.expect == (os.path.join("v1", "instances"), os.path.join("v1", "mdc"))
