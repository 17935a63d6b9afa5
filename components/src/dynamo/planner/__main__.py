"""``python -m dynamo.planner``: scale prefill and decode pools from the FPM streams.

    python -m dynamo.planner [run] --namespace NS --connector virtual|local|kubernetes [options]
    python -m dynamo.planner replay FILE.jsonl [--config ...] [--json]
    python -m dynamo.planner config [--config ...]        # print the validated effective config
    python -m dynamo.planner simulate --trace FILE [...]  # the planner on Dynamo's fleet simulator

Exit codes: 0 ok, 2 bad configuration or arguments, 3 a service (NATS, etcd, Kubernetes) unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from typing import Any
from urllib.parse import urlparse

from dynamo.common.cli_setup import add_version_flag, loopback_by_default, setup_logging

from .config import ConfigError, PlannerConfig, config_from_mapping, load_config_arg, load_config_text, merge
from .upstream import FLAG_KEYS as UPSTREAM_FLAG_KEYS
from .upstream import RULES as UPSTREAM_RULES
from .upstream import Translation, mapping_table, translate

logger = logging.getLogger("dynamo.planner")

EXIT_OK, EXIT_CONFIG, EXIT_SERVICE = 0, 2, 3


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file (YAML/JSON) or inline JSON/YAML text")
    p.add_argument("--namespace", help="Dynamo namespace (default: env DYN_NAMESPACE, else dynamo)")
    p.add_argument("--interval", type=float, dest="interval_s", help="seconds between decisions (default: 5)")
    p.add_argument(
        "--target",
        choices=["throughput", "latency", "load", "sla"],
        help="scaling target (default: throughput)",
    )
    p.add_argument("--gpu-budget", type=int, help="GPUs for both pools together (default: none)")
    p.add_argument(
        "--json", action="store_true", dest="json_stdout", help="decisions as JSON lines on stdout"
    )
    up = p.add_argument_group(
        "upstream Dynamo planner keys as flags (mapped to ours; see 'config --mapping', "
        "docs/from-upstream.md)"
    )
    for key in UPSTREAM_FLAG_KEYS:
        up.add_argument(
            "--" + key.replace("_", "-"),
            dest=f"upstream_{key}",
            metavar="V",
            default=None,
            help=f"upstream key {key}: "
            + (UPSTREAM_RULES[key].ours if UPSTREAM_RULES[key].ours != "-" else UPSTREAM_RULES[key].note),
        )
    up.add_argument("--no-operation", dest="upstream_no_operation", action="store_const", const=True,
                    help="upstream's pre-1.0 flag: dry_run")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dynamo.planner", description=__doc__.split("\n")[0])
    add_version_flag(parser, "dynamo.planner")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="observe, decide and act (the default command)")
    _common(run)
    run.add_argument(
        "--connector", choices=["virtual", "local", "kubernetes"], help="how to act (default: virtual)"
    )
    run.add_argument("--dry-run", action="store_true", default=None, help="decide and log, never act")
    run.add_argument("--decision-log", help="append decisions as JSON lines to this file")
    run.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (default: env PLANNER_PROMETHEUS_PORT, upstream's; 0: "
        "off)",
    )
    run.add_argument(
        "--metrics-host",
        help="address --metrics-port binds (default: env DYN_SYSTEM_HOST, else 127.0.0.1; 0.0.0.0 opens it)",
    )
    run.add_argument("--nats-url", help="NATS server (default: env NATS_SERVER, else nats://localhost:4222)")
    run.add_argument(
        "--frontend-metrics-url",
        help="the frontends' Prometheus endpoints, comma-separated (every replica), e.g. "
        "http://frontend:8000/metrics: their request rate keeps a busy prefill pool from being "
        "consolidated (default: none)",
    )
    run.add_argument("--frontend-model", help="count only this model's requests at the frontends")
    run.add_argument(
        "--event-plane",
        choices=["nats", "zmq"],
        help="event plane of the FPM records and the runtime "
        "(default: env DYN_EVENT_PLANE, else nats if NATS_SERVER or --nats-url is set, else zmq)",
    )
    run.add_argument(
        "--tui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live summary on stderr (default: on a terminal)",
    )
    run.add_argument("--prefill-command", help="local connector: prefill worker command template")
    run.add_argument("--decode-command", help="local connector: decode worker command template")
    run.add_argument("--log-dir", help="local connector: folder for worker logs (default: planner-logs)")
    run.add_argument(
        "--k8s-deployment",
        help="kubernetes connector: DynamoGraphDeployment name (default: env DYN_PARENT_DGD_K8S_NAME)",
    )
    run.add_argument(
        "--k8s-namespace",
        help="kubernetes connector: its namespace (default: env POD_NAMESPACE, else the service account's)",
    )
    run.add_argument("--max-ticks", type=int, help="stop after this many decisions (tests, scripted runs)")
    run.add_argument(
        "--log-level",
        default=None,
        help="logging level: debug, info, warn, error (default: env DYN_LOG, else info)",
    )
    rp = sub.add_parser("replay", help="recorded FPM JSON lines -> decisions and a timeline")
    rp.add_argument("file", help="JSON lines of recv_forward_pass_metrics --json ('-' = stdin)")
    rp.add_argument(
        "--step", type=float, default=0.1, help="seconds between lines without a time stamp (default: 0.1)"
    )
    _common(rp)
    cp = sub.add_parser(
        "config",
        help="print the validated effective configuration as JSON (upstream keys: their mapping on stderr)",
    )
    _common(cp)
    cp.add_argument(
        "--mapping",
        action="store_true",
        help="print how every upstream Dynamo 1.6.1 planner key maps to ours, and exit",
    )
    from .sim.cli import add_parser as add_simulate

    add_simulate(sub)
    return parser


def upstream_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Upstream keys given as flags (``--max-gpu-budget 8``), values read as YAML scalars."""
    out: dict[str, Any] = {}
    for key in (*UPSTREAM_FLAG_KEYS, "no_operation"):
        raw = getattr(args, f"upstream_{key}", None)
        if raw is None:
            continue
        out[key] = raw if not isinstance(raw, str) else load_config_text(f"v: {raw}")["v"]
    return out


def translated_config(args: argparse.Namespace) -> Translation:
    """The config file (or text) with upstream keys and flags mapped to ours; our flags not yet applied."""
    data = merge(load_config_arg(getattr(args, "config", None)), upstream_flags(args))
    return translate(data, os.environ)


def effective_config(args: argparse.Namespace, translation: Translation | None = None) -> PlannerConfig:
    translation = translation or translated_config(args)
    data = translation.data
    over: dict[str, Any] = {}
    for key in (
        "namespace",
        "interval_s",
        "target",
        "gpu_budget",
        "connector",
        "dry_run",
        "decision_log",
        "metrics_port",
        "metrics_host",
        "nats_url",
        "frontend_metrics_url",
        "frontend_model",
        "event_plane",
        "tui",
    ):
        v = getattr(args, key, None)
        if v is not None:
            over[key] = v
    if getattr(args, "json_stdout", False):
        over["json_stdout"] = True
    local = {
        k: getattr(args, a)
        for k, a in (
            ("prefill_command", "prefill_command"),
            ("decode_command", "decode_command"),
            ("log_dir", "log_dir"),
        )
        if getattr(args, a, None)
    }
    if local:
        over["local"] = local
    k8s = {
        k: getattr(args, a)
        for k, a in (("deployment", "k8s_deployment"), ("k8s_namespace", "k8s_namespace"))
        if getattr(args, a, None)
    }
    if k8s:
        over["kubernetes"] = k8s
    data = merge(data, over)
    if args.command == "simulate" and getattr(args, "scenario", None):
        from .sim.runs import SUITE_FLEET_LIMITS

        # A named scenario runs with the benchmarks' fleet limits unless the config sets its own, so that
        # a run by hand reproduces the benchmark's row.
        data = merge(SUITE_FLEET_LIMITS, data)
    port = os.environ.get("PLANNER_PROMETHEUS_PORT", "")
    if "metrics_port" not in data and args.command in (None, "run", "config") and port.strip():
        if not port.strip().isdigit():
            raise ConfigError(f"metrics_port: PLANNER_PROMETHEUS_PORT={port!r} is not a port")
        if int(port) > 0:
            data["metrics_port"] = int(port)
    if "namespace" not in data and os.environ.get("DYN_NAMESPACE"):
        data["namespace"] = os.environ["DYN_NAMESPACE"]
    if "tui" not in data and args.command in (None, "run"):
        data["tui"] = sys.stderr.isatty() and not data.get("json_stdout", False)
    try:
        return config_from_mapping(data)
    except ConfigError as exc:
        raise translation.explain(exc) from exc


def _reachable(url: str, default_port: int, timeout: float = 2.0) -> bool:
    for one in url.split(","):
        u = urlparse(one.strip() if "://" in one else "x://" + one.strip())
        try:
            with socket.create_connection((u.hostname or "localhost", u.port or default_port), timeout):
                return True
        except OSError:
            continue
    return False


def make_runtime(cfg: PlannerConfig, loop: asyncio.AbstractEventLoop) -> Any:
    """The Dynamo runtime, or a ConnectionError *before* it would block for 120 s on a dead service."""
    discovery = cfg.resolved_discovery(dict(os.environ))
    # The VirtualConnectorCoordinator keeps its state in etcd whatever the discovery backend.
    if discovery == "etcd" or (cfg.connector == "virtual" and not cfg.dry_run):
        etcd = os.environ.get("ETCD_ENDPOINTS", "http://localhost:2379")
        if not _reachable(etcd, 2379):
            raise ConnectionError(
                f"etcd not reachable at {etcd} (set ETCD_ENDPOINTS, or discovery_backend: file)"
            )
    plane = cfg.resolved_event_plane(dict(os.environ))
    if plane == "nats":
        nats = os.environ.get("NATS_SERVER", "nats://localhost:4222")
        if not _reachable(nats, 4222):
            raise ConnectionError(f"NATS not reachable at {nats} (set NATS_SERVER or --nats-url)")
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(loop, discovery, cfg.request_plane, event_plane=plane)


async def build_connector(cfg: PlannerConfig, runtime: Any) -> Any:
    from .connector_base import DryRunConnector

    if cfg.dry_run:
        return DryRunConnector()
    if cfg.connector == "virtual":
        from .connector_virtual import VirtualConnector

        return VirtualConnector(
            runtime,
            cfg.namespace,
            check_interval_s=cfg.virtual.check_interval_s,
            max_wait_time_s=cfg.virtual.max_wait_time_s,
        )
    if cfg.connector == "local":
        from .connector_local import LocalConnector

        lc = cfg.local
        return LocalConnector(
            prefill_command=lc.prefill_command,
            decode_command=lc.decode_command,
            log_dir=lc.log_dir,
            namespace=cfg.namespace,
            stop_timeout_s=lc.stop_timeout_s,
            hung_after_s=lc.hung_after_s,
            initial_prefill=lc.initial_prefill,
            initial_decode=lc.initial_decode,
            standby_prefill=lc.standby_prefill,
            standby_decode=lc.standby_decode,
            max_prefill=cfg.prefill.max_replicas,
            max_decode=cfg.decode.max_replicas,
            adopt=lc.adopt,
        )
    from .connector_kubernetes import KubernetesConnector

    return KubernetesConnector(cfg.kubernetes)


async def run_planner(
    cfg: PlannerConfig, *, max_ticks: int | None = None, stop: asyncio.Event | None = None
) -> int:
    from dynamo.common.fpm_tracker import FpmTracker

    from .decision_log import DecisionLog
    from .loop import Planner
    from .metrics import PlannerMetrics

    if cfg.nats_url:
        os.environ["NATS_SERVER"] = cfg.nats_url
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        plane = cfg.resolved_event_plane(dict(os.environ))
    except ValueError as exc:
        print(f"dynamo.planner: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    # On the ZMQ plane the FPM records come through the runtime's subscriber: no runtime, no records.
    needs_runtime = (cfg.connector == "virtual" and not cfg.dry_run) or plane == "zmq"
    runtime = None
    if needs_runtime or cfg.use_model_cards:
        try:
            runtime = make_runtime(cfg, loop)
        except ConnectionError as exc:
            if needs_runtime:
                print(f"dynamo.planner: error: {exc}", file=sys.stderr)
                return EXIT_SERVICE
            logger.warning("model cards off: %s; capacity comes from configuration", exc)
    cards: dict[str, Any] = {}
    if runtime is not None and cfg.use_model_cards:
        from .model_cards import ModelCardSource

        for pool, comp in (("prefill", cfg.prefill_component), ("decode", cfg.decode_component)):
            try:
                cards[pool] = ModelCardSource(runtime, cfg.namespace, comp, cfg.endpoint)
            except Exception as exc:
                logger.warning("model cards of %s unavailable: %r", comp, exc)
    connector = await build_connector(cfg, runtime)
    try:
        await connector.start()
    except ConfigError as exc:
        print(f"dynamo.planner: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:
        print(f"dynamo.planner: error: {cfg.connector} connector: {exc}", file=sys.stderr)
        return EXIT_SERVICE
    metrics = PlannerMetrics()
    metrics.set_sla_targets(cfg.sla.ttft_ms, cfg.sla.itl_ms)
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, addr=cfg.resolved_metrics_host(dict(os.environ)))
    log = DecisionLog(cfg.decision_log, stdout=cfg.json_stdout)
    arrivals = None
    if cfg.frontend_urls():
        from .arrivals import FrontendArrivals

        arrivals = FrontendArrivals(cfg.frontend_urls(), model=cfg.frontend_model)
    planner = Planner(cfg, connector, log=log, metrics=metrics, cards=cards, arrivals=arrivals)
    tracker = FpmTracker(
        cfg.namespace,
        endpoint=cfg.endpoint,
        nats_url=cfg.nats_url,
        stale_after=cfg.stale_after_s,
        max_engines=cfg.max_engines,
        event_plane=plane,
        runtime=runtime,
        components=(cfg.prefill_component, cfg.decode_component),
    )
    tracker.add_listener(planner.on_record)
    planner.transport = tracker.transport
    try:
        try:
            await tracker.start()
        except ConnectionError as exc:
            print(f"dynamo.planner: error: {exc}", file=sys.stderr)
            return EXIT_SERVICE
        logger.info(
            "planner on namespace %s (FPM on the %s event plane), connector %s%s",
            cfg.namespace,
            plane,
            connector.name,
            " (dry run)" if cfg.dry_run else "",
        )
        await planner.run(stop, max_ticks=max_ticks)
    finally:
        await tracker.stop()
        await connector.close()
        for source in cards.values():
            source.close()
        log.close()
        if runtime is not None:
            runtime.shutdown()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "replay", "config", "simulate", "-h", "--help", "--version"):
        argv.insert(0, "run")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "config" and args.mapping:
        width = max(len(k) for k, _, _ in mapping_table())
        print(f"{'upstream 1.6.1 key':<{width}}  ours  (note)")
        for key, ours, note in mapping_table():
            print(f"{key:<{width}}  {ours}" + (f"  ({note})" if note else ""))
        return EXIT_OK
    try:
        translation = translated_config(args)
        cfg = effective_config(args, translation)
    except ConfigError as exc:
        print(f"dynamo.planner: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command != "run":
        for entry in translation.entries:
            print(entry.line(), file=sys.stderr)
    if args.command in ("run", "config") and cfg.connector == "kubernetes" and not cfg.dry_run:
        from .connector_kubernetes import resolve_target

        try:  # before connecting to anything: the DGD name may come from the pod's environment
            resolve_target(cfg.kubernetes, os.environ)
        except ConfigError as exc:
            print(f"dynamo.planner: config error: {translation.explain(exc)}", file=sys.stderr)
            return EXIT_CONFIG
    if args.command == "config":
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return EXIT_OK
    if args.command == "simulate":
        from .sim.cli import run as run_simulate

        return run_simulate(args, cfg)
    if args.command == "replay":
        from .replay import run_replay

        try:
            stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            print(f"dynamo.planner: error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        with stream:
            run_replay(stream, cfg, sys.stdout, as_json=cfg.json_stdout, step=args.step)
        return EXIT_OK
    setup_logging(args.log_level)
    loopback_by_default()  # the runtime's system server (DYN_SYSTEM_PORT), unless DYN_SYSTEM_HOST says
    for entry in translation.entries:
        logger.info("%s", entry.line())
    return asyncio.run(run_planner(cfg, max_ticks=args.max_ticks))


if __name__ == "__main__":
    sys.exit(main())
