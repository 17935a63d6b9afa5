"""Command line of ``python -m dynamo.vllm``: our flags plus vLLM's own engine arguments, unchanged.

Parsing is split from validation so bad arguments fail fast with one line (exit code 2) before any
runtime or engine is created, and so validation can be tested without vLLM's heavy imports.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from dynamo.common import event_plane
from dynamo.common.cli_setup import add_version_flag
from dynamo.common.fpm_subjects import (
    DECODE_COMPONENT,
    DEFAULT_ENDPOINT,
    DEFAULT_NAMESPACE,
    PREFILL_COMPONENT,
)
from dynamo.vllm.fpm_env import flag

INSTRUMENTED_SCHEDULER = "dynamo.vllm.instrumented_scheduler.InstrumentedScheduler"
DISAGGREGATION_MODES = ("agg", "prefill", "decode")
DISCOVERY_BACKENDS = ("file", "etcd", "kubernetes", "mem")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("nats", "zmq")
EXIT_BAD_ARGS = 2
# Upstream Dynamo 1.6.1 worker flags we have no equivalent for: refused by name, not as "unrecognized".
UPSTREAM_ONLY_FLAGS = frozenset(
    {
        "--connector",
        "--use-vllm-tokenizer",
        "--route-to-encoder",
        "--enable-multimodal",
        "--enable-rl",
        "--mm-prompt-template",
        "--custom-encoder-class",
        "--embedding-transfer-mode",
        "--embedding-worker",
        "--embedding-worker-processes",
        "--realtime",
        "--classify-worker",
        "--headless",
        "--model-express-url",
        "--gms-shadow-mode",
        "--benchmark-mode",
        "--kv-state-endpoint",
        "--response-plane",
        "--fpm-trace",
        "--dyn-tool-call-parser",
        "--dyn-reasoning-parser",
        "--dyn-default-thinking-mode",
        "--dyn-structural-tag",
        "--endpoint-types",
        "--dump-config-to",
        "--health-check-payload",
        "--engine-request-limit",
        "--tcp-tls-cert-path",
        "--tcp-tls-key-path",
        "--tcp-tls-ca-cert-path",
    }
)
WORKER_GROUP = "Dynamo worker options"


class ConfigError(ValueError):
    """A bad argument combination; its message is the one-line reason printed before exiting 2."""


@dataclass
class WorkerConfig:
    """Everything the worker decides from its command line; ``engine_args`` is vLLM's own object."""

    model: str
    served_model_name: str
    disaggregation_mode: str = "agg"
    namespace: str = DEFAULT_NAMESPACE
    component: str = DECODE_COMPONENT
    endpoint: str = DEFAULT_ENDPOINT
    discovery_backend: str = "file"
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    fpm_enabled: bool = True
    custom_jinja_template: str | None = None
    standby: bool = False
    state_file: str | None = None
    local_prefill: bool = True
    scheduler_cls: str | None = None
    kv_transfer_config: Any = None
    engine_args: Any = field(default=None, repr=False)

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_bool(name: str, default: bool) -> bool:
    """An on/off variable, read by the engine process's own parser (``fpm_env.flag``); a bad value exits 2."""
    try:
        return flag(os.environ, name, default)
    except ValueError as exc:
        fail(str(exc))


def default_event_plane() -> str:
    """NATS when a NATS server is configured, otherwise ZMQ: the one rule of ``dynamo.common.event_plane``."""
    return event_plane.default_event_plane()


def component_for_mode(mode: str) -> str:
    """Upstream's convention that planners rely on: prefill workers serve under ``prefill``."""
    return PREFILL_COMPONENT if mode == "prefill" else DECODE_COMPONENT


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Our own flags (vLLM's engine arguments are added next to them by ``build_parser``)."""
    add_version_flag(parser, "dynamo.vllm")
    g = parser.add_argument_group(
        WORKER_GROUP,
        "Flags added by dynamo.vllm; every other flag is vLLM's own engine argument, passed unchanged.",
    )
    g.add_argument(
        "--disaggregation-mode",
        choices=DISAGGREGATION_MODES,
        default=_env("DYN_VLLM_DISAGGREGATION_MODE", None) or _env("DYN_DISAGGREGATION_MODE", "agg"),
        help="agg: prefill and decode in this engine; prefill: prefill-only worker (component 'prefill'); "
        "decode: decode worker fed by prefill workers. prefill/decode need --kv-transfer-config. "
        "env: DYN_VLLM_DISAGGREGATION_MODE (upstream's name), else DYN_DISAGGREGATION_MODE",
    )
    g.add_argument(
        "--namespace",
        default=_env("DYN_NAMESPACE", DEFAULT_NAMESPACE),
        help="Dynamo namespace. env: DYN_NAMESPACE",
    )
    g.add_argument(
        "--component",
        default=None,
        help="Dynamo component of the generate endpoint; unset: 'prefill' in prefill mode, 'backend' "
        "otherwise",
    )
    g.add_argument(
        "--endpoint",
        default=_env("DYN_ENDPOINT", None),
        help=f"Dynamo endpoint name (default: {DEFAULT_ENDPOINT}), or upstream's full form "
        "dyn://namespace.component.endpoint (also without dyn://), which sets all three. env: DYN_ENDPOINT",
    )
    g.add_argument(
        "--discovery-backend",
        choices=DISCOVERY_BACKENDS,
        default=_env("DYN_DISCOVERY_BACKEND", "file"),
        help="Dynamo discovery backend; 'file' keeps its state in DYN_FILE_KV (one machine, no etcd). "
        "env: DYN_DISCOVERY_BACKEND",
    )
    g.add_argument(
        "--request-plane",
        choices=REQUEST_PLANES,
        default=_env("DYN_REQUEST_PLANE", "tcp"),
        help="Dynamo request plane. env: DYN_REQUEST_PLANE",
    )
    g.add_argument(
        "--event-plane",
        choices=EVENT_PLANES,
        default=_env("DYN_EVENT_PLANE", None),
        help="Dynamo event plane. env: DYN_EVENT_PLANE; unset: nats if NATS_SERVER is set, else zmq",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=float(_env("DYN_DRAIN_TIMEOUT_S", "30") or 30),
        help="Seconds in-flight requests may take to finish after SIGTERM before they are aborted. "
        "env: DYN_DRAIN_TIMEOUT_S",
    )
    port = _env("DYN_WORKER_METRICS_PORT", None)
    g.add_argument(
        "--metrics-port",
        type=int,
        default=int(port) if port and port.isdigit() else None,
        help="Serve the worker's Prometheus metrics (FPM publisher counters, in-flight requests, "
        "readiness) on this port; 0 picks a free port; unset: off (the same metrics are also on the "
        "runtime's system server when DYN_SYSTEM_PORT is set). env: DYN_WORKER_METRICS_PORT",
    )
    g.add_argument(
        "--metrics-host",
        default=_env("DYN_SYSTEM_HOST", "127.0.0.1"),
        help="Address --metrics-port binds; 0.0.0.0 opens it to other hosts (a container's probes and "
        "scrapers need that). env: DYN_SYSTEM_HOST, which also sets the runtime's system server "
        "(DYN_SYSTEM_PORT) address; unset: 127.0.0.1 for both",
    )
    g.add_argument(
        "--fpm",
        dest="fpm_enabled",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("DYN_FPM_ENABLED", True),
        help="Publish forward-pass metrics from the engine's scheduler to NATS_SERVER. env: DYN_FPM_ENABLED",
    )
    g.add_argument(
        "--custom-jinja-template",
        default=_env("DYN_CUSTOM_JINJA_TEMPLATE", None),
        help="Chat template file for the frontend, for models whose tokenizer has none; unset: the model's. "
        "env: DYN_CUSTOM_JINJA_TEMPLATE",
    )
    g.add_argument(
        "--standby",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("DYN_VLLM_STANDBY", False),
        help="Load the engine but stay unregistered (no routing, no FPM) until SIGUSR1 registers the "
        "worker; SIGHUP then parks it again (unregister, drain, stand by). env: DYN_VLLM_STANDBY",
    )
    g.add_argument(
        "--local-prefill",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("DYN_VLLM_LOCAL_PREFILL", True),
        help="Decode workers: while no prefill worker is registered the frontend sends requests straight "
        "here and this engine computes their prompts (degraded mode, no outage); --no-local-prefill keeps "
        "the model unavailable (HTTP 503) until a prefill worker registers. env: DYN_VLLM_LOCAL_PREFILL",
    )
    g.add_argument(
        "--state-file",
        default=_env("DYN_WORKER_STATE_FILE", None),
        help="Write the worker's state (loading, standby, serving, draining) to this JSON file for a "
        "supervisor. env: DYN_WORKER_STATE_FILE",
    )


class WorkerArgumentParser(argparse.ArgumentParser):
    """Prints argparse errors as one line and exits 2 (usage text is in --help)."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2: the contract for every bad argument."""
    first = " ".join(str(message).split())
    print(f"dynamo.vllm: error: {first}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_ARGS)


def build_parser() -> argparse.ArgumentParser:
    """Our flags plus every vLLM engine argument (imports vLLM, ~10 s)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Parser(WorkerArgumentParser, FlexibleArgumentParser):
        def format_help(self) -> str:
            """vLLM's grouped help, plus our own flags spelled out (vLLM's: ``--help=all``)."""
            text = super().format_help()
            if getattr(self, "_search_keyword", None) is not None:
                return text
            formatter = self._get_formatter()
            for group in self._action_groups:
                if group.title == WORKER_GROUP:
                    formatter.start_section(group.title)
                    formatter.add_arguments(group._group_actions)
                    formatter.end_section()
            formatter.add_text(
                "vLLM engine arguments: --help=all, or --help=<group name> (e.g. --help=CacheConfig)."
            )
            return f"{text}\n{formatter.format_help()}"

    parser = _Parser(
        prog="python -m dynamo.vllm",
        description="Dynamo vLLM worker: serves a vLLM engine behind Dynamo's frontend and publishes "
        "forward-pass metrics (FPM) to NATS.",
    )
    add_worker_arguments(parser)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def model_path_problem(model: str) -> str | None:
    """Why ``model`` cannot be loaded, decided without vLLM: a missing local path, or a hub name offline."""
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        return None if os.path.isdir(expanded) else f"model path {model!r} is not a directory"
    looks_local = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1
    if looks_local:
        return f"model path {model!r} does not exist"
    if _env_bool("HF_HUB_OFFLINE", False):
        return f"model {model!r} is not a local folder and HF_HUB_OFFLINE is set"
    return None


def validate(config: WorkerConfig) -> None:
    """Raise ``ConfigError`` with a one-line reason for any bad combination of our flags."""
    problem = model_path_problem(config.model)
    if problem:
        raise ConfigError(problem)
    if config.disaggregation_mode in ("prefill", "decode") and not config.kv_transfer_config:
        raise ConfigError(
            f"--disaggregation-mode {config.disaggregation_mode} needs --kv-transfer-config "
            '(e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}\')'
        )
    if config.disaggregation_mode == "agg" and config.kv_transfer_config:
        pass  # allowed: an aggregated engine may still use a connector (e.g. offloading)
    if config.drain_timeout_s < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {config.drain_timeout_s}")
    if config.metrics_port is not None and not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be in 0..65535, got {config.metrics_port}")
    for name in ("namespace", "component", "endpoint"):
        value = getattr(config, name)
        if not value or "." in value or " " in value:
            raise ConfigError(f"--{name} must be a non-empty name without dots or spaces, got {value!r}")
    if config.custom_jinja_template and not os.path.isfile(config.custom_jinja_template):
        raise ConfigError(f"--custom-jinja-template {config.custom_jinja_template!r} is not a file")


def resolve_endpoint(
    endpoint: str | None, namespace: str, component: str | None, mode: str
) -> tuple[str, str, str]:
    """(namespace, component, endpoint) from our flags, where ``--endpoint`` may be upstream's
    ``dyn://namespace.component.endpoint`` (it then sets all three, as upstream's does)."""
    value = endpoint or DEFAULT_ENDPOINT
    if value.startswith("dyn://") or "." in value:
        parts = value.removeprefix("dyn://").split(".")
        if len(parts) != 3 or not all(parts):
            raise ConfigError(f"--endpoint {value!r}: expected a name or dyn://namespace.component.endpoint")
        if component and component != parts[1]:
            raise ConfigError(
                f"--endpoint {value!r} names component {parts[1]!r}, --component says {component!r}"
            )
        return parts[0], parts[1], parts[2]
    return namespace, component or component_for_mode(mode), value


def config_from_namespace(ns: argparse.Namespace, engine_args: Any) -> WorkerConfig:
    """Build our config from parsed flags; ``engine_args`` is ``AsyncEngineArgs.from_cli_args(ns)``."""
    served = getattr(engine_args, "served_model_name", None)
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    mode = ns.disaggregation_mode
    namespace, component, endpoint = resolve_endpoint(ns.endpoint, ns.namespace, ns.component, mode)
    return WorkerConfig(
        model=engine_args.model,
        served_model_name=served or engine_args.model,
        disaggregation_mode=mode,
        namespace=namespace,
        component=component,
        endpoint=endpoint,
        discovery_backend=ns.discovery_backend,
        request_plane=ns.request_plane,
        event_plane=ns.event_plane or default_event_plane(),
        drain_timeout_s=ns.drain_timeout,
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        fpm_enabled=ns.fpm_enabled,
        custom_jinja_template=ns.custom_jinja_template,
        standby=ns.standby,
        state_file=ns.state_file,
        local_prefill=ns.local_prefill,
        scheduler_cls=_scheduler_name(engine_args.scheduler_cls),
        kv_transfer_config=engine_args.kv_transfer_config,
        engine_args=engine_args,
    )


def _scheduler_name(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return f"{value.__module__}.{value.__qualname__}"


def prevalidate(argv: list[str]) -> None:
    """Check our own flags, the model path and the disaggregation needs before importing vLLM (~10 s)."""
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        return
    pre = WorkerArgumentParser(add_help=False, allow_abbrev=False)
    add_worker_arguments(pre)
    pre.add_argument("--model", default=None)
    pre.add_argument("--kv-transfer-config", default=None)
    ns, _ = pre.parse_known_args(argv)
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in UPSTREAM_ONLY_FLAGS:
            fail(f"{flag}: upstream Dynamo's flag is not supported by this worker (docs/from-upstream.md)")
    try:
        resolve_endpoint(ns.endpoint, ns.namespace, ns.component, ns.disaggregation_mode)
    except ConfigError as exc:
        fail(str(exc))
    if ns.model:
        problem = model_path_problem(ns.model)
        if problem:
            fail(problem)
    if ns.disaggregation_mode in ("prefill", "decode") and not ns.kv_transfer_config:
        fail(
            f"--disaggregation-mode {ns.disaggregation_mode} needs --kv-transfer-config "
            '(e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}\')'
        )


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """Parse and validate; on any problem print one line and exit 2 (no runtime, no engine yet)."""
    prevalidate(list(sys.argv[1:] if argv is None else argv))
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = build_parser()
    ns = parser.parse_args(argv)
    problem = model_path_problem(str(ns.model))
    if problem:
        fail(problem)
    try:
        engine_args = AsyncEngineArgs.from_cli_args(ns)
        config = config_from_namespace(ns, engine_args)
        validate(config)
    except ConfigError as exc:
        fail(str(exc))
    except (ValueError, TypeError) as exc:
        fail(f"{type(exc).__name__}: {exc}")
    return config
