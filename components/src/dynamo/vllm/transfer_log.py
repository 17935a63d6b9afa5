"""Rate-limited tracebacks for vLLM's KV-transfer failures.

vLLM's NIXL worker logs every failed transfer with a full traceback (``NIXL transfer failure: ...`` with
``exc_info``): one prefill worker lost under 4 requests wrote 36 traceback lines into a decode worker's log.
:class:`TracebackLimiter` keeps the first traceback of each failure kind per ``interval_s`` and turns the
others into their one-line message plus the exception's one-line summary; nothing is dropped. The CPU
connector layer (``cpu_host.nixl_connector``) installs it on vLLM's NIXL worker logger.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

from dynamo.vllm.fpm_env import number

ENV_INTERVAL = "DYN_NIXL_TRACEBACK_INTERVAL_S"
DEFAULT_INTERVAL_S = 60.0
NIXL_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def interval_from(env: Mapping[str, str]) -> float:
    """``DYN_NIXL_TRACEBACK_INTERVAL_S`` (seconds, ``0`` = keep every traceback); ValueError if bad."""
    return number(env, ENV_INTERVAL, DEFAULT_INTERVAL_S, what="a number of seconds (0 = keep all)")


class TracebackLimiter(logging.Filter):
    """Lets one traceback per failure kind (the record's first argument, else its format string) through per
    ``interval_s``; later records of that kind lose their traceback and name the exception in one line."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self.shortened = 0
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or self.interval_s <= 0:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        kind = str(args[0]).split(".")[0] if args else str(record.msg)
        now = self.clock()
        last = self._last.get(kind)
        if last is None or now - last >= self.interval_s:
            self._last[kind] = now
            return True
        exc = record.exc_info[1]
        once = f"traceback logged once per {self.interval_s:g} s"
        record.msg = f"{record.getMessage()} | {type(exc).__name__}: {exc} ({once})"
        record.args = None
        record.exc_info = None
        record.exc_text = None
        self.shortened += 1
        return True


def install(
    logger_name: str = NIXL_WORKER_LOGGER, env: Mapping[str, str] | None = None
) -> TracebackLimiter | None:
    """Add one limiter to ``logger_name`` (idempotent); None when switched off (interval 0)."""
    interval = interval_from(os.environ if env is None else env)
    logger = logging.getLogger(logger_name)
    for existing in logger.filters:
        if isinstance(existing, TracebackLimiter):
            return existing
    if interval == 0:
        return None
    limiter = TracebackLimiter(interval)
    logger.addFilter(limiter)
    return limiter
