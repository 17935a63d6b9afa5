"""The CPU compatibility layer's decisions and mechanisms, without engines (seconds).

The engine-level evidence for each problem (idle CPU, re-pinned model thread, slow first pull) is in
test_nixl_cpu_engines.py.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from dynamo.vllm.cpu_host import nixl_connector
from dynamo.vllm.cpu_host.nixl_connector import CpuFixPlan, plan_fixes


def test_defaults_on_cpu_in_process() -> None:
    plan = plan_fixes(is_cpu_platform=True, in_process_engine=True, env={})
    assert plan == CpuFixPlan(
        progress_delay_us=2000, keep_affinity=True, switch_interval_s=0.0002, spread_threads=True
    )


def test_switch_interval_only_for_in_process_engines() -> None:
    plan = plan_fixes(is_cpu_platform=True, in_process_engine=False, env={})
    assert plan.switch_interval_s is None
    assert plan.progress_delay_us == 2000 and plan.keep_affinity


def test_nothing_changes_off_the_cpu_platform() -> None:
    env = {
        nixl_connector.ENV_PROGRESS_DELAY_US: "5000",
        nixl_connector.ENV_KEEP_AFFINITY: "1",
        nixl_connector.ENV_SWITCH_INTERVAL: "0.001",
        nixl_connector.ENV_SPREAD_THREADS: "1",
    }
    plan = plan_fixes(is_cpu_platform=False, in_process_engine=True, env=env)
    assert plan == CpuFixPlan()
    assert not plan.active


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DYN_NIXL_CPU_PROGRESS_DELAY_US": "0"}, CpuFixPlan(None, True, 0.0002, True)),
        ({"DYN_NIXL_CPU_PROGRESS_DELAY_US": "500"}, CpuFixPlan(500, True, 0.0002, True)),
        ({"DYN_NIXL_CPU_KEEP_AFFINITY": "0"}, CpuFixPlan(2000, False, 0.0002, True)),
        ({"DYN_NIXL_CPU_KEEP_AFFINITY": "off"}, CpuFixPlan(2000, False, 0.0002, True)),
        ({"DYN_NIXL_CPU_SWITCH_INTERVAL": "0"}, CpuFixPlan(2000, True, None, True)),
        ({"DYN_NIXL_CPU_SWITCH_INTERVAL": "0.001"}, CpuFixPlan(2000, True, 0.001, True)),
        ({"DYN_NIXL_CPU_SPREAD_THREADS": "0"}, CpuFixPlan(2000, True, 0.0002, False)),
        (
            {
                "DYN_NIXL_CPU_PROGRESS_DELAY_US": "0",
                "DYN_NIXL_CPU_KEEP_AFFINITY": "false",
                "DYN_NIXL_CPU_SWITCH_INTERVAL": "0",
                "DYN_NIXL_CPU_SPREAD_THREADS": "no",
            },
            CpuFixPlan(None, False, None, False),
        ),
    ],
)
def test_each_fix_has_its_own_switch(env: dict[str, str], expected: CpuFixPlan) -> None:
    assert plan_fixes(is_cpu_platform=True, in_process_engine=True, env=env) == expected


@pytest.mark.parametrize(
    "env",
    [
        {"DYN_NIXL_CPU_PROGRESS_DELAY_US": "fast"},
        {"DYN_NIXL_CPU_PROGRESS_DELAY_US": "-1"},
        {"DYN_NIXL_CPU_KEEP_AFFINITY": "maybe"},
        {"DYN_NIXL_CPU_SWITCH_INTERVAL": "-0.1"},
        {"DYN_NIXL_CPU_SPREAD_THREADS": "2"},
    ],
)
def test_invalid_values_raise_instead_of_silently_disabling(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=next(iter(env))):
        plan_fixes(is_cpu_platform=True, in_process_engine=True, env=env)


def test_this_host_is_the_cpu_platform() -> None:
    """The tests below assume vLLM sees a CPU platform here; on GPU hosts the plan is empty."""
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    assert nixl_connector.current_plan({}).active


def test_progress_delay_reaches_the_agent_config_of_a_real_agent() -> None:
    """nixl's API hard-codes pthrDelay=0; inside the fix its config class stores the configured delay."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    api = sys.modules[base_worker.NixlWrapper.__module__]
    real_bindings = api.nixlBind
    assert real_bindings.nixlAgentConfig().pthrDelay == 0  # what nixl would build by default
    with nixl_connector.progress_delay(1234):
        cfg = api.nixlBind.nixlAgentConfig()
        cfg.pthrDelay = 0  # exactly what nixl_agent.__init__ does
        assert cfg.pthrDelay == 1234
        assert isinstance(cfg, real_bindings.nixlAgentConfig)
        agent = base_worker.NixlWrapper("nixl-cpu-test", base_worker.nixl_agent_config(num_threads=1))
        assert "UCX" in agent.backends
    assert api.nixlBind is real_bindings
    del agent


def test_kept_affinity_restores_a_repinned_thread() -> None:
    """The same call vLLM's NIXL worker makes on CPU, undone by the fix; the thread's own set stays."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs at least 2 usable cores to observe re-pinning")
    with nixl_connector.kept_affinity():
        os.sched_setaffinity(0, {max(before)})
        assert os.sched_getaffinity(0) == {max(before)}
    assert os.sched_getaffinity(0) == before


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _nixl_threads_affinity(fixes: CpuFixPlan) -> set[frozenset[int]]:
    """Create a real NIXL agent from a thread pinned to one core (as vLLM's CPU worker pins OpenMP
    thread 0) while another thread of the process may use every core; return the new threads' sets."""
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    everything = os.sched_getaffinity(0)
    other_core_user = threading.Event()
    helper = threading.Thread(target=other_core_user.wait, daemon=True)
    helper.start()  # keeps "every core" among the process's thread affinities, like OpenMP thread 1
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(everything)})
        existing = _thread_ids()
        with nixl_connector.apply_worker_fixes(fixes):
            agent = base_worker.NixlWrapper(
                f"spread-{fixes.spread_threads}", base_worker.nixl_agent_config(num_threads=2)
            )
        assert os.sched_getaffinity(0) == {min(everything)}  # the caller's own binding is put back
        created = _thread_ids() - existing
        assert created, "creating a NIXL agent starts threads (UCX progress, async, transfer pool)"
        sets = {frozenset(os.sched_getaffinity(tid)) for tid in created}
        del agent
        return sets
    finally:
        os.sched_setaffinity(0, before)
        other_core_user.set()
        helper.join()


def test_spread_threads_lets_nixl_threads_leave_the_model_threads_core() -> None:
    """Without the fix every NIXL thread inherits the one core; with it they may use every core."""
    everything = frozenset(os.sched_getaffinity(0))
    if len(everything) < 2:
        pytest.skip("needs at least 2 usable cores to observe pinning")
    assert _nixl_threads_affinity(CpuFixPlan()) == {frozenset({min(everything)})}
    assert _nixl_threads_affinity(CpuFixPlan(spread_threads=True)) == {everything}


def test_spread_threads_leaves_a_repinning_inside_the_block_alone() -> None:
    """vLLM re-pins the caller inside the block; undoing that is kept_affinity's job, not this fix's."""
    everything = os.sched_getaffinity(0)
    if len(everything) < 2:
        pytest.skip("needs at least 2 usable cores")
    try:
        os.sched_setaffinity(0, {min(everything)})
        with nixl_connector.spread_new_threads():
            os.sched_setaffinity(0, {max(everything)})
        assert os.sched_getaffinity(0) == {max(everything)}
    finally:
        os.sched_setaffinity(0, everything)


def test_apply_worker_fixes_sets_the_switch_interval_and_never_raises_it() -> None:
    original = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with nixl_connector.apply_worker_fixes(CpuFixPlan(switch_interval_s=0.0003)):
            pass
        assert sys.getswitchinterval() == pytest.approx(0.0003)
        with nixl_connector.apply_worker_fixes(CpuFixPlan(switch_interval_s=0.001)):
            pass
        assert sys.getswitchinterval() == pytest.approx(0.0003)  # already lower: left alone
        sys.setswitchinterval(0.005)
        with nixl_connector.apply_worker_fixes(CpuFixPlan()):
            pass
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(original)


def test_connector_is_vllms_under_the_same_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector

    assert nixl_connector.NixlConnector.__name__ == "NixlConnector"
    assert issubclass(nixl_connector.NixlConnector, VllmNixlConnector)
    cfg = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_consumer",
        kv_buffer_device="cpu",
        kv_connector_module_path="dynamo.vllm.cpu_host.nixl_connector",
    )
    assert KVConnectorFactory.get_connector_class(cfg) is nixl_connector.NixlConnector
    assert cfg.has_connector("NixlConnector")


def test_the_old_module_path_still_loads_the_connector() -> None:
    """Configs written before the move (``kv_connector_module_path: dynamo.vllm.nixl_cpu``) keep working."""
    import importlib

    from dynamo.vllm.cpu_host.nixl_connector import NixlConnector

    assert importlib.import_module("dynamo.vllm.nixl_cpu").NixlConnector is NixlConnector
