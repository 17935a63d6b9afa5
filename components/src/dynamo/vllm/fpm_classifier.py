"""Request status -> kind of queued work: the one place that knows vLLM's waiting statuses.

Pure logic over vLLM's request objects (duck-typed: ``request_id``, ``status``,
``num_computed_tokens``, ``num_tokens``); no publishing, no logging on the hot path.

Queued classes (a request in a waiting container, not in this pass):

- ``PREFILL``: ``WAITING``, the structured-output grammar wait (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``,
  older vLLM ``WAITING_FOR_FSM``), ``WAITING_FOR_STREAMING_REQ``. Length (for the variance) =
  ``num_tokens``; tokens still to compute = ``num_tokens - num_computed_tokens`` (equal to ``num_tokens``
  for a fresh request, as upstream counts it).
- ``DECODE_TRANSFER``: ``WAITING_FOR_REMOTE_KVS`` whose KV is still in flight; KV = ``num_computed_tokens``
  (vLLM sets it to the length being transferred in before the data arrives).
- ``DECODE_READY``: ``WAITING_FOR_REMOTE_KVS`` already in ``finished_recving_kv_req_ids`` (arrived, waiting
  for promotion), or a promoted request whose KV arrived and that still waits for a slot
  (``WAITING``/``PREEMPTED`` in the ``kv_arrived`` set); KV = ``num_computed_tokens``.
- ``DECODE_PREEMPTED``: ``PREEMPTED``; KV = ``num_computed_tokens``, or ``num_tokens`` when recompute
  preemption reset ``num_computed_tokens`` to 0 (the context it must rebuild).
- ``DECODE_PENDING``: a disaggregated decode engine's remote-prefill request whose KV pull has not started
  (``WAITING``, nothing computed, the connector will load it asynchronously: ``do_remote_prefill``). Its
  prefill runs on a prefill worker; here it waits for a decode slot (or the ``--max-num-inflight-kv-loads``
  cap) and then for its KV, so it is queued decode with KV = ``num_tokens`` (the context it will hold).
- ``UNKNOWN``: a status this module does not know. Explicit fallback: counted as queued prefill
  (like ``WAITING``) and reported by the scheduler (logged once per status, counted).
"""

from __future__ import annotations

import ast
import enum
import inspect
import re
import textwrap
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dynamo.common.forward_pass_metrics import IntMoments, QueuedRequestMetrics


class ContainerRole(enum.Enum):
    """What a scheduler attribute holding ``Request`` objects is to the queue accounting."""

    WAITING = "waiting queue: scanned, each request classified by status"
    RUNNING = "the running batch: never queued"
    INDEX = "every live request, by id"
    BOOKKEEPING = "a subset of the queues above, kept for vLLM's own bookkeeping"


@dataclass(frozen=True, slots=True)
class KnownContainer:
    name: str
    role: ContainerRole
    versions: str  # the vLLM versions that have it (documentation; docs/scheduler.md has the table)


# Every attribute of a vLLM scheduler known to hold ``Request`` objects, each listed once with the versions
# that have it. The drift guard (``find_request_containers``) compares a live scheduler with this list.
KNOWN_CONTAINERS: tuple[KnownContainer, ...] = (
    KnownContainer("kv_holding_waiting", ContainerRole.WAITING, "0.32-0.34"),
    KnownContainer("waiting", ContainerRole.WAITING, "all"),
    KnownContainer("async_kv_waiting", ContainerRole.WAITING, "0.34 (with --max-num-inflight-kv-loads)"),
    KnownContainer("skipped_waiting", ContainerRole.WAITING, "around 0.18"),
    KnownContainer("running", ContainerRole.RUNNING, "all"),
    KnownContainer("requests", ContainerRole.INDEX, "all"),
    KnownContainer("deferred_waiting", ContainerRole.BOOKKEEPING, "0.32-0.34"),
    KnownContainer("_inflight_prefills", ContainerRole.BOOKKEEPING, "0.32-0.34"),
    KnownContainer("_parked_reservations", ContainerRole.BOOKKEEPING, "0.34"),
    KnownContainer("_kv_fetch_stages", ContainerRole.BOOKKEEPING, "0.32-0.34"),
)
KNOWN_CONTAINER_NAMES: frozenset[str] = frozenset(c.name for c in KNOWN_CONTAINERS)
# The waiting containers, in the order vLLM drains them (the full scan reads these).
KNOWN_WAITING_CONTAINERS: tuple[str, ...] = tuple(
    c.name for c in KNOWN_CONTAINERS if c.role is ContainerRole.WAITING
)

PREFILL_STATUSES = frozenset(
    {"WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_FSM", "WAITING_FOR_STREAMING_REQ"}
)
REMOTE_KV_STATUSES = frozenset({"WAITING_FOR_REMOTE_KVS"})
PREEMPTED_STATUSES = frozenset({"PREEMPTED"})
NOT_QUEUED_STATUSES = frozenset({"RUNNING"})  # plus every finished status (name starts with FINISHED_)


class Kind(enum.IntEnum):
    """What a status means for queue accounting (per status, before per-request details)."""

    NOT_QUEUED = 0
    PREFILL = 1
    REMOTE_KV = 2
    PREEMPTED = 3
    UNKNOWN = 4


class QueueClass(enum.IntEnum):
    """Where one queued request is counted."""

    PREFILL = 1
    DECODE_TRANSFER = 2
    DECODE_READY = 3
    DECODE_PREEMPTED = 4
    UNKNOWN = 5  # counted as prefill
    DECODE_PENDING = 6  # remote prefill, KV pull not started: queued decode, in neither split part


def kind_of_status_name(name: str) -> Kind:
    if name in PREFILL_STATUSES:
        return Kind.PREFILL
    if name in REMOTE_KV_STATUSES:
        return Kind.REMOTE_KV
    if name in PREEMPTED_STATUSES:
        return Kind.PREEMPTED
    if name in NOT_QUEUED_STATUSES or name.startswith("FINISHED"):
        return Kind.NOT_QUEUED
    return Kind.UNKNOWN


def status_kinds(status_enum: Iterable[Any]) -> dict[Any, Kind]:
    """The table the hot path looks statuses up in (enum member -> Kind)."""
    return {member: kind_of_status_name(member.name) for member in status_enum}


def unknown_statuses(status_enum: Iterable[Any]) -> list[str]:
    """Names in vLLM's status enum this classifier does not know (startup self-check)."""
    return [m.name for m in status_enum if kind_of_status_name(m.name) is Kind.UNKNOWN]


# A classification: (class, length_or_kv, tokens_to_compute). For decode classes the third is 0.
Entry = tuple[QueueClass, int, int]


def classify(
    kind: Kind, computed: int, num_tokens: int, kv_ready: bool, kv_arrived: bool, pull_pending: bool = False
) -> Entry | None:
    """Classify one request given its status kind; ``None`` when it is not queued.

    ``pull_pending``: the request's KV will be loaded from a remote prefill and the load has not started
    (only looked at for a ``WAITING``-like status with nothing computed)."""
    if kind is Kind.PREFILL:
        if computed > 0:
            if kv_arrived:
                return (QueueClass.DECODE_READY, computed, 0)
        elif pull_pending:
            return (QueueClass.DECODE_PENDING, num_tokens, 0)
        return (QueueClass.PREFILL, num_tokens, num_tokens - computed)
    if kind is Kind.REMOTE_KV:
        return (QueueClass.DECODE_READY if kv_ready else QueueClass.DECODE_TRANSFER, computed, 0)
    if kind is Kind.PREEMPTED:
        if kv_arrived and computed > 0:
            return (QueueClass.DECODE_READY, computed, 0)
        return (QueueClass.DECODE_PREEMPTED, computed if computed > 0 else num_tokens, 0)
    if kind is Kind.NOT_QUEUED:
        return None
    return (QueueClass.UNKNOWN, num_tokens, num_tokens - computed)


# Whether a waiting request's KV will be pulled from a remote prefill (the load not started yet); None when
# the engine cannot load KV asynchronously (no KV connector).
PullPending = Callable[[Any], bool] | None


def remote_prefill_flag(request: Any) -> bool:
    """vLLM's default for "may load async" (0.32's NixlConnector and 0.34's ``may_load_async``): the
    ``do_remote_prefill`` transfer parameter, which the connector clears once the load is set up."""
    params = getattr(request, "kv_transfer_params", None)
    return bool(params and params.get("do_remote_prefill"))


def classify_request(
    request: Any, kinds: Mapping[Any, Kind], ready_ids: Any, kv_arrived: Any, pull_pending: PullPending = None
) -> tuple[Kind, Entry | None]:
    """Classify a vLLM request object (status looked up in ``kinds``; unknown members -> UNKNOWN)."""
    status = request.status
    kind = kinds.get(status)
    if kind is None:
        kind = kind_of_status_name(getattr(status, "name", str(status)))
    rid = request.request_id
    computed = request.num_computed_tokens
    return kind, classify(
        kind,
        computed,
        request.num_tokens,
        rid in ready_ids,
        rid in kv_arrived,
        pull_pending is not None and kind is Kind.PREFILL and computed == 0 and pull_pending(request),
    )


class QueueTotals:
    """Exact running totals of the queued classes; entries are added and removed in any order."""

    __slots__ = ("decode", "prefill", "prefill_tokens", "ready_n", "ready_s", "transfer_n", "transfer_s")

    def __init__(self) -> None:
        self.prefill = IntMoments()  # over lengths (num_tokens)
        self.prefill_tokens = 0  # tokens still to compute
        self.decode = IntMoments()  # over KV tokens, all decode classes
        self.transfer_n = self.transfer_s = 0
        self.ready_n = self.ready_s = 0

    def add(self, entry: Entry) -> None:
        cls, value, tokens = entry
        if cls is QueueClass.PREFILL or cls is QueueClass.UNKNOWN:
            self.prefill.add(value)
            self.prefill_tokens += tokens
            return
        self.decode.add(value)
        if cls is QueueClass.DECODE_TRANSFER:
            self.transfer_n += 1
            self.transfer_s += value
        elif cls is QueueClass.DECODE_READY:
            self.ready_n += 1
            self.ready_s += value

    def remove(self, entry: Entry) -> None:
        cls, value, tokens = entry
        if cls is QueueClass.PREFILL or cls is QueueClass.UNKNOWN:
            self.prefill.remove(value)
            self.prefill_tokens -= tokens
            return
        self.decode.remove(value)
        if cls is QueueClass.DECODE_TRANSFER:
            self.transfer_n -= 1
            self.transfer_s -= value
        elif cls is QueueClass.DECODE_READY:
            self.ready_n -= 1
            self.ready_s -= value

    def metrics(self) -> QueuedRequestMetrics:
        p, d = self.prefill, self.decode
        return QueuedRequestMetrics(
            num_prefill_requests=p.n,
            sum_prefill_tokens=self.prefill_tokens,
            var_prefill_length=p.variance(),
            num_decode_requests=d.n,
            sum_decode_kv_tokens=d.s,
            var_decode_kv_tokens=d.variance(),
            num_decode_kv_transfer_requests=self.transfer_n,
            sum_decode_kv_transfer_tokens=self.transfer_s,
            num_decode_kv_ready_requests=self.ready_n,
            sum_decode_kv_ready_tokens=self.ready_s,
        )


def waiting_containers(scheduler: Any) -> list[tuple[str, Any]]:
    """The known waiting containers this scheduler instance actually has."""
    found = []
    for name in KNOWN_WAITING_CONTAINERS:
        container = getattr(scheduler, name, None)
        if container is not None:
            found.append((name, container))
    return found


def requests_in(container: Any) -> Iterable[Any]:
    """The requests a container holds: a queue, set or list as is; a dict's values, or its keys when those
    are the requests (``dict[Request, int]``)."""
    if isinstance(container, dict):
        for key in container:
            return container if hasattr(key, "request_id") else container.values()
        return ()
    return container


class ScanResult:
    """A full scan of the waiting containers: totals, per-request entries, and anomalies seen."""

    __slots__ = ("duplicates", "entries", "not_queued", "totals", "unknown")

    def __init__(self) -> None:
        self.totals = QueueTotals()
        self.entries: dict[str, Entry] = {}
        self.duplicates = 0  # the same request in two containers (counted once)
        self.not_queued: list[str] = []  # running/finished requests found in a waiting container
        self.unknown: dict[str, int] = {}  # unknown status name -> requests


def scan_containers(
    containers: Iterable[Any],
    kinds: Mapping[Any, Kind],
    ready_ids: Any,
    kv_arrived: Any,
    pull_pending: PullPending = None,
) -> ScanResult:
    """Classify every request of every container once (the reference the incremental path must equal)."""
    result = ScanResult()
    entries = result.entries
    for container in containers:
        for request in requests_in(container):
            rid = request.request_id
            if rid in entries:
                result.duplicates += 1
                continue
            kind, entry = classify_request(request, kinds, ready_ids, kv_arrived, pull_pending)
            if entry is None:
                result.not_queued.append(rid)
                continue
            if kind is Kind.UNKNOWN:
                name = getattr(request.status, "name", str(request.status))
                result.unknown[name] = result.unknown.get(name, 0) + 1
            entries[rid] = entry
            result.totals.add(entry)
    return result


# ------------------------------------------------------------ drift guard: containers nobody told us about
_COLLECTIONS = (list, tuple, set, frozenset, deque, dict)


def find_request_containers(
    scheduler: Any, request_type: type, queue_types: tuple[type, ...] = ()
) -> dict[str, Any]:
    """Every attribute of ``scheduler`` that holds (or is made to hold) request objects.

    Found by what can be seen when the scheduler is built, while every container is still empty: an
    instance of vLLM's request-queue class, a collection whose ``self.<name>: ...`` annotation in the
    ``__init__`` of a class of the scheduler names ``Request``, or a collection that already holds a
    ``request_type`` object (an un-annotated container, found once it is filled: the audits look again).
    """
    annotated = _annotated_request_attributes(type(scheduler))
    found = {}
    for name, value in vars(scheduler).items():
        if (queue_types and isinstance(value, queue_types)) or (
            isinstance(value, _COLLECTIONS) and (name in annotated or _holds(value, request_type))
        ):
            found[name] = value
    return found


def unknown_request_containers(found: Iterable[str]) -> list[str]:
    """Names of request containers that are not in :data:`KNOWN_CONTAINERS` (sorted)."""
    return sorted(set(found) - KNOWN_CONTAINER_NAMES)


def _holds(container: Any, request_type: type) -> bool:
    if isinstance(container, dict):
        for key, value in container.items():
            return isinstance(key, request_type) or isinstance(value, request_type)
        return False
    for item in container:
        return isinstance(item, request_type)
    return False


_ANNOTATED: dict[type, frozenset[str]] = {}


def _annotated_request_attributes(cls: type) -> frozenset[str]:
    """``self.<name>: <annotation naming Request>`` in the ``__init__`` of ``cls`` and its bases (read once
    per class from the source; a class without source contributes nothing)."""
    cached = _ANNOTATED.get(cls)
    if cached is None:
        cached = _ANNOTATED[cls] = _read_annotations(cls)
    return cached


def _read_annotations(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Attribute)
                and isinstance(node.target.value, ast.Name)
                and node.target.value.id == "self"
                and _names_request(node.annotation)
            ):
                names.add(node.target.attr)
    return frozenset(names)


def _names_request(annotation: ast.expr) -> bool:
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            word = node.id
        elif isinstance(node, ast.Attribute):
            word = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = "Request" if _REQUEST_WORD.search(node.value) else ""
        else:
            continue
        if word == "Request":
            return True
    return False


_REQUEST_WORD = re.compile(r"\bRequest\b")
