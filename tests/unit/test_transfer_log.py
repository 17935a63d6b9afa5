"""vLLM's KV-transfer failure tracebacks: the first of each kind per interval keeps its traceback, the others
become one line naming the exception; nothing is dropped."""

from __future__ import annotations

import logging

import pytest
from dynamo.vllm import transfer_log


def _fail(logger: logging.Logger, kind: str) -> None:
    try:
        raise RuntimeError(f"{kind} went wrong")
    except RuntimeError as exc:
        logger.error("NIXL transfer failure: %s | Context: %s", kind, {"id": 1}, exc_info=exc)


def test_one_traceback_per_kind_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    logger = logging.getLogger("test.transfer_log")
    limiter = transfer_log.TracebackLimiter(60.0, clock=lambda: now[0])
    logger.addFilter(limiter)
    try:
        with caplog.at_level(logging.ERROR, logger="test.transfer_log"):
            for _ in range(4):
                _fail(logger, "handshake_failed")
            _fail(logger, "transfer_failed. Marking blocks as invalid")
            now[0] += 61
            _fail(logger, "handshake_failed")
    finally:
        logger.removeFilter(limiter)
    records = caplog.records
    assert len(records) == 6  # nothing dropped
    assert [r.exc_info is not None for r in records] == [True, False, False, False, True, True]
    assert (
        "RuntimeError: handshake_failed went wrong (traceback logged once per 60 s)"
        in records[1].getMessage()
    )
    assert "Context: {'id': 1}" in records[1].getMessage() and "\n" not in records[1].getMessage()
    assert limiter.shortened == 3


def test_setting_and_install() -> None:
    assert transfer_log.interval_from({}) == 60.0
    assert transfer_log.interval_from({transfer_log.ENV_INTERVAL: "0"}) == 0.0
    for bad in ("-1", "x", "nan"):
        with pytest.raises(ValueError, match=transfer_log.ENV_INTERVAL):
            transfer_log.interval_from({transfer_log.ENV_INTERVAL: bad})
    name = "test.transfer_log.install"
    assert transfer_log.install(name, {transfer_log.ENV_INTERVAL: "0"}) is None
    first = transfer_log.install(name, {})
    assert first is not None and transfer_log.install(name, {}) is first  # idempotent
    logging.getLogger(name).removeFilter(first)


def test_the_cpu_layer_installs_it_on_vllms_nixl_worker_logger() -> None:
    pytest.importorskip("vllm")
    import dynamo.vllm.cpu_host.nixl_connector  # noqa: F401

    nixl_logger = logging.getLogger(transfer_log.NIXL_WORKER_LOGGER)
    assert any(isinstance(f, transfer_log.TracebackLimiter) for f in nixl_logger.filters)
