"""Cheaper waits between vLLM's engine processes on CPU hosts (a vLLM general plugin, off unless asked for).

vLLM's multi-process engine hands every step between its EngineCore process and its worker process through a
shared-memory ring buffer (``vllm.distributed.device_communicators.shm_broadcast``). A reader that got a
message less than 1 s ago waits for the next one by calling ``sched_yield()`` in a loop. On a GPU host that
loop has cores to spare; on a small CPU host it costs a core per engine process for as long as requests keep
coming. Measured on 2 cores (a prefill and a decode worker behind the frontend, requests back to back): the
prefill worker's process spent 88% of a core in that loop and a disaggregated request took 610 ms; with 100 us
sleeps in place of the yields, 83 ms. While a new pair made its first transfer the decode worker's process was
once seen taking 1.65 of the 2 cores for 17 s, with 12-20 other processes (frontend, Dynamo runtimes,
keep-alives) waiting.

With ``DYN_VLLM_SHM_WAIT_SLEEP_US`` set to a positive number of microseconds, the ring buffer's waits sleep
that long instead of yielding (the waits themselves, their 1 s busy period and vLLM's wake-up path are
unchanged). ``python -m dynamo.vllm`` sets it to :data:`DEFAULT_SLEEP_US` for prefill and decode workers on
vLLM's CPU platform unless it is already set; ``0`` keeps vLLM's ``sched_yield``. vLLM loads general plugins
in each of its processes, so the variable, inherited from the worker, takes effect in the EngineCore and
worker processes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from types import ModuleType

from dynamo.vllm.env_values import number

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
