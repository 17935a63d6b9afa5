"""Opt-in CPU compatibility layer for vLLM's ``NixlConnector`` (prefill/decode disaggregation on CPU hosts).

Select it with ``"kv_connector": "NixlConnector"`` and
``"kv_connector_module_path": "dynamo.vllm.cpu_host.nixl_connector"``. The class below *is* vLLM's
``NixlConnector`` (a subclass under the same name, so vLLM's own ``has_connector("NixlConnector")`` checks and
KV-layout choices still apply); it only changes how the connector's worker side is set up, and only on vLLM's
CPU platform. On GPU hosts it behaves exactly like vLLM's connector.

Why: four problems measured on small CPU hosts, each with its own switch
(docs/workarounds.md#the-cpu-nixl-layer; details in docs/disaggregation.md#the-four-fixes-and-their-switches):

- ``DYN_NIXL_CPU_PROGRESS_DELAY_US`` (default 2000): UCX progress thread's poll delay (nixl's 0: busy poll).
- ``DYN_NIXL_CPU_KEEP_AFFINITY`` (default 1): the model thread's affinity restored after vLLM's NIXL setup.
- ``DYN_NIXL_CPU_SWITCH_INTERVAL`` (seconds, default 0.0002): shorter GIL switch interval, in-process engines.
- ``DYN_NIXL_CPU_SPREAD_THREADS`` (default 1): NIXL's threads created on every core the process uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dynamo.vllm import transfer_log
from dynamo.vllm.fpm_env import flag, number

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

logger = logging.getLogger(__name__)

# One traceback per kind of transfer failure per minute in vLLM's NIXL worker log, one line for the others.
transfer_log.install()

ENV_PROGRESS_DELAY_US = "DYN_NIXL_CPU_PROGRESS_DELAY_US"
ENV_KEEP_AFFINITY = "DYN_NIXL_CPU_KEEP_AFFINITY"
ENV_SWITCH_INTERVAL = "DYN_NIXL_CPU_SWITCH_INTERVAL"
ENV_SPREAD_THREADS = "DYN_NIXL_CPU_SPREAD_THREADS"

DEFAULT_PROGRESS_DELAY_US = 2000
DEFAULT_SWITCH_INTERVAL_S = 0.0002

__all__ = [
    "ENV_KEEP_AFFINITY",
    "ENV_PROGRESS_DELAY_US",
    "ENV_SPREAD_THREADS",
    "ENV_SWITCH_INTERVAL",
    "CpuFixPlan",
    "NixlConnector",
    "apply_worker_fixes",
    "plan_fixes",
]


@dataclass(frozen=True)
class CpuFixPlan:
    """Which fixes to apply around the creation of a NIXL connector worker (None/False: leave alone)."""

    progress_delay_us: int | None = None
    keep_affinity: bool = False
    switch_interval_s: float | None = None
    spread_threads: bool = False

    @property
    def active(self) -> bool:
        return (
            self.progress_delay_us is not None
            or self.keep_affinity
            or self.switch_interval_s is not None
            or self.spread_threads
        )


def plan_fixes(*, is_cpu_platform: bool, in_process_engine: bool, env: Mapping[str, str]) -> CpuFixPlan:
    """Decide the fixes from the platform and the environment; pure, so every combination is testable.

    Nothing is applied off the CPU platform: GPU hosts get vLLM's connector unchanged. Invalid values
    raise, so a typo never silently turns a fix off.
    """
    delay = int(number(env, ENV_PROGRESS_DELAY_US, DEFAULT_PROGRESS_DELAY_US))
    keep = flag(env, ENV_KEEP_AFFINITY, True)
    interval = number(env, ENV_SWITCH_INTERVAL, DEFAULT_SWITCH_INTERVAL_S)
    spread = flag(env, ENV_SPREAD_THREADS, True)
    if not is_cpu_platform:
        return CpuFixPlan()
    return CpuFixPlan(
        progress_delay_us=delay if delay > 0 else None,
        keep_affinity=keep,
        switch_interval_s=interval if interval > 0 and in_process_engine else None,
        spread_threads=spread,
    )


_patch_lock = threading.Lock()


class _BindingsWithDelay:
    """Stands in for nixl's ``_bindings`` module inside nixl's ``_api`` while one agent is created.

    nixl's ``nixl_agent.__init__`` assigns ``pthrDelay = 0`` to the agent config it builds; the config
    class handed out here turns that assignment into the configured delay. Everything else is forwarded.
    """

    def __init__(self, bindings: ModuleType, delay_us: int) -> None:
        base = bindings.nixlAgentConfig
        descriptor = base.__dict__["pthrDelay"]

        def _set_delay(cfg: Any, _value: int) -> None:
            descriptor.__set__(cfg, delay_us)

        self._bindings = bindings
        self.nixlAgentConfig = type(
            "nixlAgentConfig",
            (base,),
            {"pthrDelay": property(descriptor.__get__, _set_delay), "configured_delay_us": delay_us},
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


@contextlib.contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """Within this block, NIXL agents created through vLLM's wrapper get ``delay_us`` of poll delay."""
    wrapper_cls = getattr(_base_worker, "NixlWrapper", None)
    # nixl's ``_api`` module, untyped (nixl ships no type information): its attributes are set below.
    api: Any = sys.modules.get(getattr(wrapper_cls, "__module__", ""), None)
    bindings = getattr(api, "nixlBind", None)
    if (
        api is None
        or not isinstance(bindings, ModuleType)
        or "pthrDelay" not in vars(bindings.nixlAgentConfig)
    ):
        logger.warning("nixl agent config not found: %s not applied", ENV_PROGRESS_DELAY_US)
        yield
        return
    with _patch_lock:
        api.nixlBind = _BindingsWithDelay(bindings, delay_us)
        try:
            yield
        finally:
            api.nixlBind = bindings


@contextlib.contextmanager
def kept_affinity() -> Iterator[None]:
    """Restore the calling thread's CPU affinity after the block if something re-pinned it."""
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            logger.info("NIXL worker setup re-pinned the model thread to %s; restored %s", after, before)


def process_cpu_set() -> set[int]:
    """Every core some thread of this process may run on (the union of the threads' affinities)."""
    cpus: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                cpus |= os.sched_getaffinity(int(task))
    return cpus or set(os.sched_getaffinity(0))


@contextlib.contextmanager
def spread_new_threads() -> Iterator[None]:
    """Threads created in this block may run on every core of the process, not only the caller's.

    Linux threads inherit their creator's affinity. The caller's own affinity is put back afterwards,
    unless something inside the block changed it (then that choice is left to ``kept_affinity``).
    """
    own = os.sched_getaffinity(0)
    wide = process_cpu_set() | own
    if wide == own:
        yield
        return
    os.sched_setaffinity(0, wide)
    try:
        yield
    finally:
        if os.sched_getaffinity(0) == wide:
            os.sched_setaffinity(0, own)
        logger.info(
            "NIXL threads created on cores %s instead of the model thread's %s", sorted(wide), sorted(own)
        )


@contextlib.contextmanager
def apply_worker_fixes(plan: CpuFixPlan) -> Iterator[None]:
    """Apply ``plan`` around the creation of a NIXL connector worker."""
    with contextlib.ExitStack() as stack:
        if plan.keep_affinity:
            stack.enter_context(kept_affinity())
        if plan.spread_threads:
            stack.enter_context(spread_new_threads())
        if plan.progress_delay_us is not None:
            stack.enter_context(progress_delay(plan.progress_delay_us))
        yield
    if plan.switch_interval_s is not None and sys.getswitchinterval() > plan.switch_interval_s:
        sys.setswitchinterval(plan.switch_interval_s)


def current_plan(env: Mapping[str, str] | None = None) -> CpuFixPlan:
    """The plan for this process: vLLM's platform and engine mode plus the environment."""
    from vllm import envs
    from vllm.platforms import current_platform

    return plan_fixes(
        is_cpu_platform=current_platform.is_cpu(),
        in_process_engine=not envs.VLLM_ENABLE_V1_MULTIPROCESSING,
        env=os.environ if env is None else env,
    )


class NixlConnector(_VllmNixlConnector):
    """vLLM's ``NixlConnector`` with the CPU fixes applied while its worker side is created."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        plan = current_plan() if role == KVConnectorRole.WORKER else CpuFixPlan()
        if plan.active:
            logger.info("NIXL CPU compatibility fixes: %s", plan)
        with apply_worker_fixes(plan):
            super().__init__(vllm_config, role, kv_cache_config)
