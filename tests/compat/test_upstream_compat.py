"""Upstream Dynamo 1.6.1's command lines and configs, unchanged, against our planner and worker.

The planner configs are read out of upstream's own DynamoGraphDeployment manifests in the unpacked
1.6.1 wheel (and the copies in docs/examples/ must match them); the worker command lines are
upstream's documented ones. Each runs, or fails with exit 2 and one line naming what is not supported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from dynamo.planner.config import ConfigError
from dynamo.planner.upstream import RULES, translate
from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.worker_support import base_env, http_text, low_free_port, start_worker, wait_until

EXAMPLES = REPO / "docs" / "examples"
MANIFESTS = "dynamo/planner/tests/manual/scaling"

pytestmark = pytest.mark.timeout(180)


def _planner_config_of(manifest: Path) -> str:
    """The ``--config`` argument of the Planner service in an upstream DGD manifest."""
    dgd = yaml.safe_load(manifest.read_text())
    args = dgd["spec"]["services"]["Planner"]["extraPodSpec"]["mainContainer"]["args"]
    return str(args[args.index("--config") + 1])


def _planner(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo.planner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("name", ["load", "throughput"])
def test_docs_examples_are_upstreams_own(upstream_dir: Path, name: str) -> None:
    ours = json.loads((EXAMPLES / f"upstream-1.6.1-planner-{name}.json").read_text())
    theirs = json.loads(_planner_config_of(upstream_dir / MANIFESTS / f"disagg_planner_{name}.yaml"))
    assert ours == theirs


# ---- planner direction -------------------------------------------------------------------------------


def test_upstream_load_config_runs_unchanged(upstream_dir: Path, nats_server: Any, tmp_path: Path) -> None:
    """Upstream's load-scaling planner config, as its manifest passes it, with the env its operator sets."""
    text = _planner_config_of(upstream_dir / MANIFESTS / "disagg_planner_load.yaml")
    env = {"DYN_PARENT_DGD_K8S_NAME": "vllm-disagg-planner", "POD_NAMESPACE": "inference"}
    shown = _planner("config", "--config", text, env=env)
    assert shown.returncode == 0, shown.stderr
    cfg = json.loads(shown.stdout)
    assert (cfg["target"], cfg["connector"], cfg["interval_s"]) == ("sla", "kubernetes", 5.0)
    assert cfg["kubernetes"]["deployment"] == "vllm-disagg-planner"
    assert cfg["kubernetes"]["k8s_namespace"] == "inference"
    assert cfg["sla"]["min_samples"] == 5 and cfg["gpu_budget"] == 8  # upstream's default budget
    assert "upstream optimization_target: 'sla' -> target: 'sla'" in shown.stderr
    assert "upstream max_gpu_budget: None -> gpu_budget: 8" in shown.stderr
    # And the planner runs on it (a dry run: no cluster here), logging the same mapping.
    log = tmp_path / "decisions.jsonl"
    run = _planner(
        "--config", text, "--dry-run", "--max-ticks", "2", "--nats-url", nats_server.url,
        "--decision-log", str(log), "--no-tui",
        env={**env, "NATS_SERVER": nats_server.url, "DYN_DISCOVERY_BACKEND": "file",
             "DYN_FILE_KV": str(tmp_path / "kv")},
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "upstream load_min_observations: 5 -> sla.min_samples: 5" in run.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows and {r["pool"] for r in rows} == {"prefill", "decode"} and all(r["dry_run"] for r in rows)


def test_upstream_throughput_config_fails_naming_what_is_not_supported(upstream_dir: Path) -> None:
    text = _planner_config_of(upstream_dir / MANIFESTS / "disagg_planner_throughput.yaml")
    r = _planner("config", "--config", text)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("dynamo.planner: config error: enable_throughput_scaling: ")
    assert "not supported" in lines[0]


def test_upstream_planner_flags_map_to_ours() -> None:
    r = _planner(
        "config", "--optimization-target", "latency", "--min-endpoint", "2", "--max-gpu-budget", "12",
        "--prefill-engine-num-gpu", "2", "--decode-engine-num-gpu", "4", "--adjustment-interval", "10",
        "--ttft", "200", "--itl", "20", "--no-operation",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["target"] == "latency" and cfg["gpu_budget"] == 12 and cfg["interval_s"] == 10.0
    assert cfg["prefill"]["min_replicas"] == cfg["decode"]["min_replicas"] == 2
    assert (cfg["prefill"]["gpus_per_replica"], cfg["decode"]["gpus_per_replica"]) == (2, 4)
    assert (cfg["sla"]["ttft_ms"], cfg["sla"]["itl_ms"], cfg["dry_run"]) == (200.0, 20.0, True)


def test_mapping_lists_every_upstream_key() -> None:
    r = _planner("config", "--mapping")
    assert r.returncode == 0, r.stderr
    keys = {line.split()[0] for line in r.stdout.splitlines()[1:]}
    assert keys == set(RULES)


def test_every_top_level_key_of_upstreams_planner_config_is_known(upstream_dir: Path) -> None:
    """Each key upstream's PlannerConfig defines is mapped, ignored or refused here, none unknown."""
    import ast

    src = (upstream_dir / "dynamo/planner/config/planner_config.py").read_text()
    cls = next(
        n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "PlannerConfig"
    )
    fields = {
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert fields and fields - {"namespace"} <= set(RULES), sorted(fields - set(RULES))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"mode": "agg", "min_endpoint": 2}, {"prefill": {"min_replicas": 0, "max_replicas": 0},
                                              "decode": {"min_replicas": 2}, "gpu_budget": 8}),
        ({"max_gpu_budget": -1, "prefill_min_endpoint": 3},
         {"gpu_budget": None, "prefill": {"min_replicas": 3}}),
        ({"optimization_target": "load", "mode": "agg", "decode_scale_up_kv_rate": 90,
          "decode_scale_down_kv_rate": 40, "prefill_scale_up_queue_tokens": 4000},
         {"target": "load", "prefill": {"min_replicas": 0, "max_replicas": 0}, "gpu_budget": 8,
          "thresholds": {"decode_up": 0.9}}),
        ({"load_scaling_down_sensitivity": 70, "metric_reporting_prometheus_port": 0, "gpu_budget": 4},
         {"sla": {"headroom": 0.7}, "metrics_port": None, "gpu_budget": 4}),
        ({"target": "latency"}, {"target": "latency"}),  # ours only: unchanged
    ],
)  # fmt: skip
def test_translation(data: dict[str, Any], expected: dict[str, Any]) -> None:
    if "target" not in data:  # an upstream config: upstream's environment unless it says
        expected = {**expected, "connector": "kubernetes"}
    assert translate(data).data == expected


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"environment": "global-planner"}, "environment"),
        ({"mode": "prefill"}, "mode"),
        ({"backend": "sglang"}, "backend"),
        ({"optimization_target": "sla", "enable_load_scaling": True}, "enable_throughput_scaling"),
        ({"optimization_target": "load", "prefill_scale_up_queue_tokens": 10},
         "prefill_scale_up_queue_tokens"),
        ({"min_gpu_budget": 4}, "min_gpu_budget"),
        ({"enable_power_awareness": True}, "enable_power_awareness"),
        ({"control_api_port": 9086}, "control_api_port"),
        ({"scheduling": {"external_plugins": [{"plugin_id": "x"}]}}, "scheduling.external_plugins"),
        ({"optimization_target": "sla", "target": "load", "enable_throughput_scaling": False,
          "enable_load_scaling": True}, "optimization_target"),  # conflicts with our own key
    ],
)  # fmt: skip
def test_refused_keys_are_named(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        translate(data)
    assert str(err.value).startswith(f"{key}: "), err.value


def test_a_check_on_a_mapped_key_names_the_upstream_key() -> None:
    r = _planner("config", "--config", '{"max_gpu_budget": 1, "min_endpoint": 1, "advisory": true}')
    assert r.returncode == 2
    assert "gpu_budget: 1 cannot hold" in r.stderr and "(set from upstream max_gpu_budget: 1)" in r.stderr


# ---- worker direction --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerCommand:
    env: dict[str, str]
    argv: list[str]
    expect: str

    def with_model(self, model: Path) -> list[str]:
        argv = list(self.argv)
        argv[argv.index("--model") + 1] = str(model)
        return argv


def _worker_commands() -> list[WorkerCommand]:
    """The commands of docs/examples/upstream-1.6.1-worker-commands.txt, each after its expect line."""
    out, expect = [], ""
    for line in (EXAMPLES / "upstream-1.6.1-worker-commands.txt").read_text().splitlines():
        if line.startswith("# expect"):
            expect = line[2:]
        elif line.strip() and not line.startswith("#"):
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper())
            argv = words[len(env) :]
            assert argv[:3] in (["python", "-m", "dynamo.vllm"], ["python3", "-m", "dynamo.vllm"]), line
            out.append(WorkerCommand(env, argv[3:], expect))
            expect = ""
    return out


COMMANDS = _worker_commands()


@pytest.mark.vllm
@pytest.mark.parametrize("command", COMMANDS, ids=[f"cmd{i}" for i in range(len(COMMANDS))])
def test_upstream_worker_command_lines(
    command: WorkerCommand,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dynamo.vllm import args as wargs

    for name in ("DYN_NAMESPACE", "DYN_ENDPOINT", "DYN_VLLM_DISAGGREGATION_MODE", "DYN_DISAGGREGATION_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    argv = command.with_model(tiny_model_dir)
    kind, _, want = command.expect.partition(": ")
    if kind == "expect-error":
        with pytest.raises(SystemExit) as exc:
            wargs.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err
        return
    assert kind == "expect", command
    mode, path = want.split()
    config = wargs.parse_args(argv)
    assert (config.disaggregation_mode, config.endpoint_path) == (mode, path)


@pytest.mark.vllm
def test_upstream_endpoint_form_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A worker started the upstream way (``--endpoint dyn://...``, mode from
    ``DYN_VLLM_DISAGGREGATION_MODE``, system server on ``DYN_SYSTEM_PORT``) registers under that endpoint."""
    kv = tmp_path / "kv"
    kv.mkdir()
    port = low_free_port()
    env = base_env(
        kv, DYN_VLLM_DISAGGREGATION_MODE="agg", DYN_NAMESPACE="elsewhere", DYN_SYSTEM_PORT=str(port)
    )
    worker = start_worker(
        tiny_model_dir, env, tmp_path / "worker.log", "--endpoint", "dyn://compat.backend.generate"
    )
    try:
        want = (
            'dynamo_worker_ready{dynamo_component="backend",dynamo_endpoint="generate",'
            'dynamo_namespace="compat",'
        )

        def registered() -> bool:
            with contextlib.suppress(OSError):
                lines = http_text(f"http://127.0.0.1:{port}/metrics").splitlines()
                return any(line.startswith(want) and line.endswith(" 1.0") for line in lines)
            return False

        wait_until(registered, timeout=240, procs=[worker])
    finally:
        worker.stop()


def test_docs_name_every_upstream_key_and_new_variable() -> None:
    guide = (REPO / "docs" / "from-upstream.md").read_text()
    missing = [k for k in RULES if f"`{k}`" not in guide]
    assert not missing, f"docs/from-upstream.md lacks {missing}"
    reference = (REPO / "docs" / "configuration.md").read_text()
    new = ("DYN_VLLM_DISAGGREGATION_MODE", "DYN_ENDPOINT", "DYN_CUSTOM_JINJA_TEMPLATE", "DYN_SYSTEM_HOST",
           "PLANNER_PROMETHEUS_PORT", "DYN_PARENT_DGD_K8S_NAME", "POD_NAMESPACE", "--version",
           "--metrics-host")  # fmt: skip
    assert not [v for v in new if f"`{v}" not in reference]


def test_an_upstream_config_gets_upstreams_environment_and_says_what_it_needs() -> None:
    r = _planner("config", "--config", '{"min_endpoint": 1}')
    assert r.returncode == 2
    assert "kubernetes.deployment: the DynamoGraphDeployment name is required" in r.stderr
    assert "DYN_PARENT_DGD_K8S_NAME" in r.stderr
    ok = _planner("config", "--config", '{"min_endpoint": 1}', env={"DYN_PARENT_DGD_K8S_NAME": "g"})
    assert ok.returncode == 0, ok.stderr
    assert "upstream environment: None -> connector: 'kubernetes'" in ok.stderr
