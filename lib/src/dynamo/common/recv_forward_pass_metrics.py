"""Watch the FPM records of a namespace live.

    python -m dynamo.common.recv_forward_pass_metrics --namespace NS [--component C] [--endpoint E] [--json]

``--json``: one JSON object per record on stdout (subject, component, endpoint, envelope time and
every FPM field nested as in the schema), flushed per line. Otherwise a compact table, one row per
engine, refreshed every ``--interval`` seconds. Either event plane (``--event-plane`` /
``DYN_EVENT_PLANE``, :mod:`dynamo.common.event_plane`): on NATS it reads ``NATS_SERVER`` (and the
``NATS_*`` auth/TLS variables of :mod:`dynamo.common.nats_options`); on ZMQ it starts a Dynamo runtime
whose subscriber finds the publishers in discovery (components ``prefill`` and ``backend`` unless
``--component`` names one). Ctrl-C exits with 0; an unreachable NATS exits with
2 after ``--connect-timeout`` seconds with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

from dynamo.common.cli_setup import add_version_flag, setup_logging
from dynamo.common.event_plane import EVENT_PLANES, resolve_event_plane
from dynamo.common.fpm_subjects import DEFAULT_NAMESPACE
from dynamo.common.fpm_tracker import FpmTracker, TrackedWorker, record_to_dict
from dynamo.common.nats_options import nats_url_from_env, redact_url

EXIT_OK, EXIT_NATS = 0, 2


def json_line(worker: TrackedWorker, subject: str) -> str:
    """The ``--json`` object of one record."""
    obj = {
        "subject": subject,
        "component": worker.key.component,
        "endpoint": worker.key.endpoint,
        "published_at_ms": worker.published_at_ms,
        **record_to_dict(worker.record),
    }
    return json.dumps(obj, separators=(",", ":"))


_COLUMNS = (
    ("component", 9),
    ("endpoint", 8),
    ("worker_id", 20),
    ("dp", 2),
    ("counter", 8),
    ("age_s", 5),
    ("wall_ms", 7),
    ("s.pre", 5),
    ("s.pre_tok", 9),
    ("s.dec", 5),
    ("s.dec_kv", 8),
    ("q.pre", 5),
    ("q.pre_tok", 9),
    ("q.dec", 5),
    ("q.dec_kv", 8),
    ("q.xfer", 6),
    ("q.ready", 7),
    ("gaps", 5),
    ("rst", 3),
)


def _fmt_row(values: list[str]) -> str:
    return " ".join(
        v[-w:].rjust(w) if i >= 3 else v[:w].ljust(w)
        for i, (v, (_, w)) in enumerate(zip(values, _COLUMNS, strict=True))
    )


def table(workers: list[TrackedWorker], now: float) -> str:
    """The live table (pure: the caller prints it)."""
    lines = [_fmt_row([name for name, _ in _COLUMNS])]
    for w in workers:
        r, s, q = w.record, w.record.scheduled_requests, w.record.queued_requests
        timing = w.last_timing_record
        opt = lambda v: "-" if v is None else str(v)  # noqa: E731
        lines.append(
            _fmt_row(
                [
                    w.key.component,
                    w.key.endpoint,
                    w.key.worker_id,
                    str(w.key.dp_rank),
                    str(r.counter_id),
                    f"{now - w.received_at:.1f}" + ("!" if w.stale else ""),
                    f"{timing.wall_time * 1000:.1f}" if timing is not None else "-",
                    str(s.num_prefill_requests),
                    str(s.sum_prefill_tokens),
                    str(s.num_decode_requests),
                    str(s.sum_decode_kv_tokens),
                    str(q.num_prefill_requests),
                    str(q.sum_prefill_tokens),
                    str(q.num_decode_requests),
                    str(q.sum_decode_kv_tokens),
                    opt(q.num_decode_kv_transfer_requests),
                    opt(q.num_decode_kv_ready_requests),
                    str(w.gaps),
                    str(w.restarts),
                ]
            )
        )
    if len(lines) == 1:
        lines.append("(no records yet)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dynamo.common.recv_forward_pass_metrics",
        description="Watch forward-pass-metrics records on the Dynamo event plane (NATS or ZMQ).",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("DYN_NAMESPACE", DEFAULT_NAMESPACE),
        help="Dynamo namespace (default: $DYN_NAMESPACE or 'dynamo')",
    )
    p.add_argument(
        "--component", default=None, help="only this component, e.g. prefill or backend (default: all)"
    )
    p.add_argument("--endpoint", default=None, help="only this endpoint (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per record instead of the live table")
    p.add_argument(
        "--interval", type=float, default=1.0, help="table refresh period in seconds (default 1.0)"
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=5.0,
        help="mark an engine stale after this many seconds (default 5)",
    )
    p.add_argument(
        "--event-plane",
        choices=EVENT_PLANES,
        default=None,
        help="where the records travel "
        "(default: $DYN_EVENT_PLANE, else nats if NATS_SERVER is set, else zmq)",
    )
    p.add_argument(
        "--discovery-backend",
        default=os.environ.get("DYN_DISCOVERY_BACKEND") or "file",
        help="zmq plane: the Dynamo discovery backend that finds the publishers "
        "(default: $DYN_DISCOVERY_BACKEND or 'file', which reads DYN_FILE_KV)",
    )
    add_version_flag(p, "dynamo.common.recv_forward_pass_metrics")
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="give up if NATS is unreachable this long (default 5)",
    )
    return p.parse_args(argv)


def _runtime(discovery_backend: str) -> Any:
    """The Dynamo runtime on the ZMQ event plane (its subscriber finds the publishers in discovery)."""
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(asyncio.get_running_loop(), discovery_backend, "tcp", event_plane="zmq")


async def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    runtime = None
    try:
        plane = resolve_event_plane(getattr(args, "event_plane", None))
        if plane == "zmq":
            runtime = _runtime(getattr(args, "discovery_backend", None) or "file")
        tracker = FpmTracker(
            args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            stale_after=args.stale_after,
            event_plane=plane,
            runtime=runtime,
        )
    except Exception as exc:  # a bad name or plane, or a runtime that cannot start
        print(f"error: {exc}", file=sys.stderr)
        if runtime is not None:
            runtime.shutdown()
        return EXIT_NATS
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    if args.json:

        def emit(worker: TrackedWorker, subject: str) -> None:
            try:
                out.write(json_line(worker, subject) + "\n")
                out.flush()
            except BrokenPipeError:
                stop.set()

        tracker.add_listener(emit)
    try:
        await tracker.start(timeout=args.connect_timeout)
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if runtime is not None:
            runtime.shutdown()
        return EXIT_NATS
    try:
        if args.json:
            await stop.wait()
        else:
            clear = "\x1b[H\x1b[2J" if out.isatty() else ""
            url = (
                redact_url(nats_url_from_env()) if plane == "nats" else f"discovery {args.discovery_backend}"
            )
            while not stop.is_set():
                st = tracker.stats()
                header = (
                    f"{tracker.describe()}  {url} {'up' if tracker.connected else 'DOWN'}  "
                    f"records={st.accepted} rejected={st.rejected()} gaps={st.gaps} restarts={st.restarts}"
                )
                try:
                    out.write(
                        f"{clear}{header}\n{table(tracker.workers(include_stale=True), time.monotonic())}\n\n"
                    )
                    out.flush()
                except BrokenPipeError:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.interval)
    finally:
        await tracker.stop()
        if runtime is not None:
            runtime.shutdown()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        code = asyncio.run(run(args))
    except KeyboardInterrupt:
        code = EXIT_OK
    with contextlib.suppress(BrokenPipeError, ValueError):
        sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
