"""The environment contract between the Dynamo worker and vLLM's engine-core process.

vLLM spawns its engine core (where the InstrumentedScheduler and the CPU layers run) as a child that
inherits the worker's environment and nothing else, so environment variables are the only channel. Both
sides use this module: the worker writes with ``FpmSettings.worker_env()``, the scheduler reads with
``FpmSettings.from_env()``, and every switch either side reads goes through ``flag`` / ``number``, which
are strict: a value that cannot be read raises ``ValueError`` naming the variable, so a typo never silently
turns something off. No vLLM import here. Every variable: docs/scheduler.md, docs/configuration.md.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamo.common.event_plane import ENV_FPM_PORT, fpm_port_from_env
from dynamo.common.fpm_subjects import DECODE_COMPONENT, DEFAULT_ENDPOINT, DEFAULT_NAMESPACE

logger = logging.getLogger(__name__)

# Written by the worker for each engine it starts (``FpmSettings.worker_env``).
ENV_ENABLED = "DYN_FPM_ENABLED"
ENV_NAMESPACE = "DYN_NAMESPACE"
ENV_COMPONENT = "DYN_FPM_COMPONENT"
ENV_ENDPOINT = "DYN_FPM_ENDPOINT"
ENV_WORKER_ID = "DYN_FPM_WORKER_ID"
ENV_NATS = "NATS_SERVER"
ENV_STATS_FILE = "DYN_FPM_STATS_FILE"
ENV_GATE_FILE = "DYN_FPM_GATE_FILE"
# Tunables an operator may set; the worker passes them through untouched.
ENV_SNAPSHOT_INTERVAL = "DYN_FPM_SNAPSHOT_INTERVAL"
ENV_HEARTBEAT_INTERVAL = "DYN_FPM_HEARTBEAT_INTERVAL"
ENV_AUDIT_INTERVAL = "DYN_FPM_AUDIT_INTERVAL"
ENV_QUEUE_ACCOUNTING = "DYN_FPM_QUEUE_ACCOUNTING"

# The publisher's per-rank counter file in the worker's private stats folder, and one field of it: finished
# requests whose KV blocks the engine still holds for a peer (a prefill worker's drain waits on it).
STATS_FILE_NAME = "fpm-stats-{dp_rank}.json"
STAT_KV_PINNED = "kv_pinned_requests"

DEFAULT_SNAPSHOT_INTERVAL = 0.25
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_AUDIT_INTERVAL = 30.0
QUEUE_ACCOUNTING_MODES = ("auto", "incremental", "scan")

SECONDS = "seconds (a number)"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off switch: 1/0, true/false, yes/no, on/off (any case); unset or empty gives ``default``."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 0/1, true/false, yes/no or on/off")


def number(
    env: Mapping[str, str], name: str, default: float, *, allow_zero: bool = True, what: str = "a number"
) -> float:
    """A number >= 0 (> 0 without ``allow_zero``); unset or empty gives ``default``.

    ``what`` names the expected unit in the error."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {what}") from None
    if value != value or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={raw!r}: must be {'>= 0' if allow_zero else '> 0'}")
    return value


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

    def worker_env(self) -> dict[str, str]:
        """The variables the worker sets for its engine: identity and wiring, never the tunables (an
        operator's own settings of those pass through the inherited environment). ``from_env`` reads them
        back."""
        env = {
            ENV_NAMESPACE: self.namespace,
            ENV_COMPONENT: self.component,
            ENV_ENDPOINT: self.endpoint,
            ENV_ENABLED: "1" if self.enabled else "0",
        }
        optional = {
            ENV_WORKER_ID: self.worker_id,
            ENV_STATS_FILE: self.stats_file,
            ENV_NATS: self.nats_url,
            ENV_GATE_FILE: self.gate_file,
            ENV_FPM_PORT: None if self.zmq_port is None else str(self.zmq_port),
        }
        env.update({name: value for name, value in optional.items() if value})
        return env

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


def stats_file_in(stats_dir: str) -> str:
    """The per-rank stats-file template inside the worker's private stats folder."""
    return os.path.join(stats_dir, STATS_FILE_NAME)


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
