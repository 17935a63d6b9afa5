"""Hooks for the vLLM engine processes a ``python -m dynamo.vllm`` worker starts (a vLLM general plugin).

vLLM loads general plugins in each of its processes: the worker's own, its EngineCore child and EngineCore's
model-runner (executor worker) children. Before it starts the engine, the worker exports its pid as
:data:`WORKER_PID_ENV`; in every *other* process that inherits the variable the plugin

- ties the process's life to its parent's (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): a worker killed with SIGKILL
  takes its EngineCore with it, and EngineCore's end takes its model-runner processes. Without it they ran on
  (about 2.5 GB with the tiny model's 1 GiB KV cache) and EngineCore's FPM publisher kept sending records, and
  heartbeats, under the dead worker's id for minutes. A parent that is already gone when the plugin runs (the
  race the kernel's tie cannot cover) ends the process at once;
- on vLLM's CPU platform, computes the sampled token's logprob rank eagerly
  (:func:`dynamo.vllm.cpu_host.logprob_ranks.eager_logprob_ranks`).

Without the variable (vLLM run by anything else) the plugin does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping

import psutil
from dynamo.vllm.cpu_host.logprob_ranks import eager_logprob_ranks

log = logging.getLogger(__name__)

WORKER_PID_ENV = "DYN_VLLM_WORKER_PID"
_PR_SET_PDEATHSIG = 1


def worker_pid(environ: Mapping[str, str]) -> int | None:
    """The pid of the Dynamo worker that started this engine, or None (not one of its engines)."""
    value = environ.get(WORKER_PID_ENV, "").strip()
    return int(value) if value.isdigit() else None


def is_engine_process(environ: Mapping[str, str], pid: int) -> bool:
    """True in a process the worker started (directly or not), False in the worker itself or elsewhere."""
    owner = worker_pid(environ)
    return owner is not None and owner != pid


def _parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def below(pid: int, owner: int) -> bool:
    """Whether ``pid`` is ``owner`` or one of its descendants (parents read with psutil).

    The owner is compared before the walk stops at PID 1: a worker that is its container's (or PID
    namespace's) PID 1 owns its engines like any other.
    """
    seen = 0
    current: int | None = pid
    while current is not None and seen < 64:
        if current == owner:
            return True
        if current <= 1:
            return False
        current, seen = _parent_of(current), seen + 1
    return False


def die_with_parent(owner: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends; end now if the worker is already gone.

    Returns whether the tie was set (False off Linux, where it is unavailable).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): engine processes may outlive the worker",
            ctypes.get_errno(),
        )
        return False
    # The parent may have ended between our fork and the prctl: the kernel then never signals us, and this
    # process now hangs below some other reaper, no longer below the worker.
    parent = os.getppid()
    if not below(parent, owner):
        # One line on stderr, flushed: the process ends before any logging handler would write.
        sys.stderr.write(
            f"dynamo engine hooks: pid {os.getpid()} exits: its parent pid {parent} is not worker pid {owner}"
            " nor below it (the worker ended before this engine process tied its life to it)\n"
        )
        sys.stderr.flush()
        os._exit(1)
    return True


def _cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover
        return False
    return bool(current_platform.is_cpu())


def register() -> None:
    """vLLM general-plugin entry point (``dynamo_engine_hooks``); inert outside a Dynamo worker's engine."""
    if not is_engine_process(os.environ, os.getpid()):
        return
    owner = worker_pid(os.environ)
    assert owner is not None
    die_with_parent(owner)
    if _cpu_platform() and not eager_logprob_ranks():
        log.warning("this vLLM has no batched_count_greater_than: the first logprobs request may compile")
