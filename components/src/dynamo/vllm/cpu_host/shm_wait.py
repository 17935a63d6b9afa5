"""Cheaper waits between vLLM's engine processes on CPU hosts (a vLLM general plugin, off unless asked for).

Why: vLLM's shared-memory ring buffer waits with ``sched_yield()`` in a loop, a core per engine process on a
small CPU host (docs/workarounds.md#engine-waits-that-sleep). With ``DYN_VLLM_SHM_WAIT_SLEEP_US`` set to a
positive number of microseconds those waits sleep instead; ``python -m dynamo.vllm`` sets it for prefill and
decode workers on vLLM's CPU platform (:mod:`dynamo.vllm.cpu_host.env_defaults`). vLLM loads general plugins
in each of its processes, so the variable, inherited from the worker, acts in EngineCore and its worker
processes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from types import ModuleType

from dynamo.vllm.fpm_env import number

log = logging.getLogger(__name__)

ENV = "DYN_VLLM_SHM_WAIT_SLEEP_US"
DEFAULT_SLEEP_US = 100
_MARK = "_dynamo_shm_wait_sleep_us"


def sleep_us_from(environ: Mapping[str, str]) -> int:
    """The configured sleep in whole microseconds (0: leave vLLM alone); a bad value names the variable."""
    return int(number(environ, ENV, 0))


def napper(sleep_us: int) -> Callable[[], None]:
    """What the ring buffer calls instead of ``sched_yield``: a real sleep, which frees the core."""
    seconds = sleep_us / 1e6

    def nap() -> None:
        time.sleep(seconds)

    return nap


def apply(module: ModuleType, sleep_us: int) -> bool:
    """Replace ``module.sched_yield`` (the ring buffer's wait step); False when this vLLM has none."""
    if sleep_us <= 0:
        return False
    if not callable(getattr(module, "sched_yield", None)):
        log.warning("%s: this vLLM's shm_broadcast has no sched_yield; its waits are left as they are", ENV)
        return False
    if getattr(module, _MARK, None) == sleep_us:
        return True
    # vLLM's own module, replaced on purpose: ModuleType declares no attributes for mypy to check.
    module.sched_yield = napper(sleep_us)  # type: ignore[attr-defined]
    setattr(module, _MARK, sleep_us)
    return True


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: acts only where :data:`ENV` is set to a positive
    number."""
    sleep_us = sleep_us_from(os.environ)
    if sleep_us <= 0:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if apply(shm_broadcast, sleep_us):
        log.debug(
            "vLLM shm ring buffer waits sleep %d us instead of yielding (pid %d)", sleep_us, os.getpid()
        )
