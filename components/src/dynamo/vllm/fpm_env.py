"""FPM settings of the instrumented scheduler, read from the environment (the worker sets them).

Pure parsing (``FpmSettings.from_env(mapping)``) so every default and error is testable; the scheduler
reads ``os.environ`` in its engine-core process. See docs/scheduler.md for the full table.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamo.common.event_plane import fpm_port_from_env
from dynamo.common.fpm_subjects import DECODE_COMPONENT, DEFAULT_ENDPOINT, DEFAULT_NAMESPACE
from dynamo.vllm.env_values import flag, number

logger = logging.getLogger(__name__)

ENV_ENABLED = "DYN_FPM_ENABLED"
ENV_NAMESPACE = "DYN_NAMESPACE"
ENV_COMPONENT = "DYN_FPM_COMPONENT"
ENV_ENDPOINT = "DYN_FPM_ENDPOINT"
ENV_WORKER_ID = "DYN_FPM_WORKER_ID"
ENV_NATS = "NATS_SERVER"
ENV_STATS_FILE = "DYN_FPM_STATS_FILE"
ENV_GATE_FILE = "DYN_FPM_GATE_FILE"
ENV_SNAPSHOT_INTERVAL = "DYN_FPM_SNAPSHOT_INTERVAL"
ENV_HEARTBEAT_INTERVAL = "DYN_FPM_HEARTBEAT_INTERVAL"
# Stats-file field: finished requests whose KV blocks the engine still holds for a peer (the drain waits on it).
STAT_KV_PINNED = "kv_pinned_requests"
ENV_AUDIT_INTERVAL = "DYN_FPM_AUDIT_INTERVAL"
ENV_QUEUE_ACCOUNTING = "DYN_FPM_QUEUE_ACCOUNTING"

DEFAULT_SNAPSHOT_INTERVAL = 0.25
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_AUDIT_INTERVAL = 30.0
QUEUE_ACCOUNTING_MODES = ("auto", "incremental", "scan")

SECONDS = "seconds (a number)"


def fallback_worker_id() -> str:
    """Stable for the life of the serving process tree: host name and process group id."""
    try:
        group = os.getpgid(0)
    except OSError:
        group = os.getpid()
    return f"{socket.gethostname()}-pg{group}"


@dataclass(frozen=True)
class FpmSettings:
    """Everything the scheduler needs to publish. ``worker_id=None`` means 'not configured'."""

    enabled: bool = True
    namespace: str = DEFAULT_NAMESPACE
    component: str = DECODE_COMPONENT
    endpoint: str = DEFAULT_ENDPOINT
    worker_id: str | None = None
    nats_url: str | None = None
    stats_file: str | None = None
    gate_file: str | None = None  # heartbeats wait while it is missing (a standby worker)
    snapshot_interval: float = DEFAULT_SNAPSHOT_INTERVAL
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    audit_interval: float = DEFAULT_AUDIT_INTERVAL
    queue_accounting: str = "auto"
    # DYN_FORWARDPASS_METRIC_PORT (upstream's): set = the ZMQ event plane, PUB on this port + dp_rank for the
    # worker's FpmEventRelay; unset = publish on NATS directly.
    zmq_port: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FpmSettings:
        """Parse the environment; raises ``ValueError`` naming the variable on a bad value."""
        env = os.environ if env is None else env
        mode = env.get(ENV_QUEUE_ACCOUNTING, "").strip().lower() or "auto"
        if mode not in QUEUE_ACCOUNTING_MODES:
            raise ValueError(f"{ENV_QUEUE_ACCOUNTING}={mode!r}: expected one of {QUEUE_ACCOUNTING_MODES}")
        return cls(
            enabled=flag(env, ENV_ENABLED, True),
            namespace=env.get(ENV_NAMESPACE, "").strip() or DEFAULT_NAMESPACE,
            component=env.get(ENV_COMPONENT, "").strip() or DECODE_COMPONENT,
            endpoint=env.get(ENV_ENDPOINT, "").strip() or DEFAULT_ENDPOINT,
            worker_id=env.get(ENV_WORKER_ID, "").strip() or None,
            nats_url=env.get(ENV_NATS, "").strip() or None,
            stats_file=env.get(ENV_STATS_FILE, "").strip() or None,
            gate_file=env.get(ENV_GATE_FILE, "").strip() or None,
            snapshot_interval=number(
                env, ENV_SNAPSHOT_INTERVAL, DEFAULT_SNAPSHOT_INTERVAL, allow_zero=False, what=SECONDS
            ),
            heartbeat_interval=number(
                env, ENV_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_INTERVAL, allow_zero=False, what=SECONDS
            ),
            audit_interval=number(env, ENV_AUDIT_INTERVAL, DEFAULT_AUDIT_INTERVAL, what=SECONDS),
            queue_accounting=mode,
            zmq_port=fpm_port_from_env(env),
        )

    def resolved_worker_id(self) -> str:
        """The configured id, or the fallback with one clear warning."""
        if self.worker_id:
            return self.worker_id
        fallback = fallback_worker_id()
        logger.warning(
            "%s is not set: publishing forward-pass metrics as worker_id=%r. Planners that match "
            "records to Dynamo instances will ignore them; the Dynamo worker sets %s for you.",
            ENV_WORKER_ID,
            fallback,
            ENV_WORKER_ID,
        )
        return fallback

    def stats_file_for(self, dp_rank: int) -> str | None:
        """The publisher stats file of one data-parallel rank (``{dp_rank}`` in the template)."""
        if not self.stats_file:
            return None
        return self.stats_file.replace("{dp_rank}", str(dp_rank))


def dp_rank_of(vllm_config: Any) -> int:
    """The data-parallel rank of this engine: ``data_parallel_index`` first, then ``data_parallel_rank``."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        try:
            value = getattr(parallel, name)
        except Exception:  # pydantic fields with init=False may be unset
            continue
        if isinstance(value, int) and value >= 0:
            return value
    return 0
