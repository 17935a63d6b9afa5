"""``python -m dynamo.frontend``: a thin launcher of the Dynamo runtime's own OpenAI-compatible frontend.

No HTTP server of our own: ``make_engine`` + ``run_input(runtime, "http", ...)`` from ``dynamo.llm``,
which tokenizes, templates, routes (prefill -> decode when disaggregated), detokenizes and streams.
Flag names follow upstream's frontend so existing launch scripts keep working.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import MutableMapping
from typing import Any, NoReturn

from dynamo.common.cli_setup import add_version_flag, loopback_by_default, setup_logging
from dynamo.common.event_plane import default_event_plane

log = logging.getLogger("dynamo.frontend")

# Upstream's inactivity bound on a worker's answer: a request whose worker sent nothing for this long ends
# with 504 and the worker is quarantined (the runtime's request plane; its HTTP layer ends the stream at twice
# the value as a safety net). Each frame restarts the clock, so a long generation is never cut; the longest
# silence of a healthy worker is a request's time to first token (queueing, the longest prompt's prefill, the
# KV transfer). Unset upstream (a request a hung worker acknowledged then waits for ever): we default it.
STREAM_TIMEOUT_ENV = "DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS"
DEFAULT_STREAM_TIMEOUT_S = 300

ROUTER_MODES = {
    "round-robin": "RoundRobin",
    "random": "Random",
    "power-of-two": "PowerOfTwoChoices",
    "kv": "KV",
    "direct": "Direct",
    "least-loaded": "LeastLoaded",
    "device-aware-weighted": "DeviceAwareWeighted",
}


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"dynamo.frontend: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m dynamo.frontend",
        description="Dynamo's OpenAI-compatible HTTP frontend (from ai-dynamo-runtime) for dynamo.vllm "
        "workers.",
    )
    add_version_flag(p, "dynamo.frontend")
    p.add_argument(
        "--http-host",
        default=_env("DYN_HTTP_HOST", "0.0.0.0"),
        help="HTTP bind address. env: DYN_HTTP_HOST (default: 0.0.0.0)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=int(_env("DYN_HTTP_PORT", "8000") or 8000),
        help="HTTP port. env: DYN_HTTP_PORT (default: 8000)",
    )
    p.add_argument(
        "--namespace",
        default=_env("DYN_NAMESPACE", None),
        help="Only serve models of this Dynamo namespace. env: DYN_NAMESPACE (default: all namespaces)",
    )
    p.add_argument(
        "--router-mode",
        choices=sorted(ROUTER_MODES),
        default=_env("DYN_ROUTER_MODE", "round-robin"),
        help="How requests are spread over workers. env: DYN_ROUTER_MODE (default: round-robin)",
    )
    p.add_argument(
        "--kv-cache-block-size",
        type=int,
        default=None,
        help="KV block size for KV routing (default: the workers' registered block size)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=0,
        help="Times a request may move to another worker when its worker disappears (default: 0)",
    )
    p.add_argument(
        "--discovery-backend",
        choices=("file", "etcd", "kubernetes", "mem"),
        default=_env("DYN_DISCOVERY_BACKEND", "file"),
        help="Discovery backend. env: DYN_DISCOVERY_BACKEND (default: file, folder DYN_FILE_KV)",
    )
    p.add_argument(
        "--request-plane",
        choices=("tcp", "nats"),
        default=_env("DYN_REQUEST_PLANE", "tcp"),
        help="Request plane. env: DYN_REQUEST_PLANE (default: tcp)",
    )
    p.add_argument(
        "--event-plane",
        choices=("nats", "zmq"),
        default=_env("DYN_EVENT_PLANE", None),
        help="Event plane. env: DYN_EVENT_PLANE (default: nats if NATS_SERVER is set, else zmq)",
    )
    return p


def default_stream_timeout(environ: MutableMapping[str, str]) -> str:
    """Set ``DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS`` to our default where it is unset or empty (an operator's
    value, ``0`` = no bound included, is kept); returns the value the runtime will read."""
    if not environ.get(STREAM_TIMEOUT_ENV):
        environ[STREAM_TIMEOUT_ENV] = str(DEFAULT_STREAM_TIMEOUT_S)
    return environ[STREAM_TIMEOUT_ENV]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not 0 <= args.http_port <= 65535:
        build_parser().error(f"--http-port must be in 0..65535, got {args.http_port}")
    if args.migration_limit < 0:
        build_parser().error("--migration-limit must be >= 0")
    if args.event_plane is None:
        args.event_plane = default_event_plane()
    return args


def entrypoint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``EntrypointArgs`` (without the router config, built next to the runtime)."""
    kwargs: dict[str, Any] = {
        "http_host": args.http_host,
        "http_port": args.http_port,
        "migration_limit": args.migration_limit,
    }
    if args.kv_cache_block_size is not None:
        kwargs["kv_cache_block_size"] = args.kv_cache_block_size
    if args.namespace:
        kwargs["namespace"] = args.namespace
    return kwargs


async def run(args: argparse.Namespace) -> None:
    from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, RouterMode, make_engine, run_input
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    router = RouterConfig(getattr(RouterMode, ROUTER_MODES[args.router_mode]))
    engine = await make_engine(
        runtime, EntrypointArgs(EngineType.Dynamic, router_config=router, **entrypoint_kwargs(args))
    )
    log.info(
        "frontend on http://%s:%d (router %s, %s=%s)",
        args.http_host,
        args.http_port,
        args.router_mode,
        STREAM_TIMEOUT_ENV,
        os.environ[STREAM_TIMEOUT_ENV],
    )
    with contextlib.suppress(asyncio.CancelledError):
        await run_input(runtime, "http", engine)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    loopback_by_default()  # the runtime's system server (DYN_SYSTEM_PORT); --http-host is separate
    default_stream_timeout(os.environ)  # before the runtime starts: it reads the environment
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        print(f"dynamo.frontend: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0
