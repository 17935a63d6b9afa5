"""The vLLM scheduler methods the InstrumentedScheduler hooks, what each hook is for, and the startup check.

A hook only runs if vLLM still calls a method of that name. When a vLLM release renames or drops one, the
override is silently never called again: the incremental queue accounting would drift until the next audit,
or forever with audits off. So the scheduler checks its base class against this table once, when it is
built, and degrades right away (and says so once) instead of publishing wrong figures:

- a method with role ``RECORD`` missing: nothing correct can be published, publishing is refused;
- a ``QUEUE`` method missing: full-scan queue accounting (exact, O(queue) per record);
- ``PREEMPTION`` missing: the scheduled side's all-decode fast path is turned off (per-request rules only);
- ``KV_ARRIVAL``, ``IDLE`` or ``SHUTDOWN`` missing: kept running, with a warning naming what is lost;
- ``HELD_KV`` missing: the held-KV fields are left out (None), with the same warning.

``tests/integration/test_scheduler_hooks.py`` checks that this table lists every vLLM method the mixin
overrides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    """What a hook contributes; the startup check decides from the roles of the missing methods."""

    RECORD = "builds, times or emits the records"
    QUEUE = "sees every change of a waiting request's class or value (incremental queue accounting)"
    PREEMPTION = "records preempted ids (the scheduled side's all-decode fast path relies on them)"
    KV_ARRIVAL = "records ids whose remote KV arrived (their first pass counts as decode, queued as ready)"
    IDLE = "switches the publisher's idle heartbeat off when work arrives and refreshes its idle record"
    SHUTDOWN = "closes the publisher"
    HELD_KV = "follows the KV blocks kept for a KV connector after their request finished (held-KV fields)"


@dataclass(frozen=True, slots=True)
class HookedMethod:
    name: str
    roles: frozenset[Role]


def _hook(name: str, *roles: Role) -> HookedMethod:
    return HookedMethod(name, frozenset(roles))


HOOKED_METHODS: tuple[HookedMethod, ...] = (
    _hook("schedule", Role.RECORD, Role.IDLE),
    _hook("update_from_output", Role.RECORD, Role.IDLE, Role.QUEUE),
    _hook("add_request", Role.QUEUE, Role.IDLE),
    _hook("finish_requests", Role.QUEUE, Role.IDLE),
    _hook("_preempt_request", Role.QUEUE, Role.PREEMPTION),
    _hook("_enqueue_waiting_request", Role.QUEUE),
    _hook("_update_request_as_session", Role.QUEUE),
    _hook("_handle_blocked_waiting_request", Role.QUEUE, Role.KV_ARRIVAL),
    _hook("_update_from_kv_xfer_finished", Role.QUEUE),
    _hook("_handle_failed_recving", Role.QUEUE),
    _hook("_handle_invalid_blocks", Role.QUEUE),
    _hook("shutdown", Role.SHUTDOWN),
    _hook("_free_request", Role.HELD_KV),
    _hook("_free_blocks", Role.HELD_KV),
)
HOOKED_NAMES: frozenset[str] = frozenset(hook.name for hook in HOOKED_METHODS)


@dataclass(frozen=True, slots=True)
class HookCheck:
    """The hooked methods a scheduler base class lacks, and what follows from it."""

    missing: tuple[HookedMethod, ...]

    @property
    def missing_names(self) -> list[str]:
        return [hook.name for hook in self.missing]

    def lacks(self, role: Role) -> list[str]:
        return [hook.name for hook in self.missing if role in hook.roles]

    @property
    def can_publish(self) -> bool:
        return not self.lacks(Role.RECORD)

    @property
    def incremental_ok(self) -> bool:
        return not self.lacks(Role.QUEUE)

    @property
    def fast_path_ok(self) -> bool:
        return not self.lacks(Role.PREEMPTION)

    def losses(self) -> list[str]:
        """One phrase per role that has a missing method (for the startup warning)."""
        return [
            f"{role.name.lower()} ({', '.join(names)}: {role.value})"
            for role in Role
            if (names := self.lacks(role))
        ]


def check_hooks(base: type) -> HookCheck:
    """Which methods of :data:`HOOKED_METHODS` ``base`` (the vLLM scheduler class hooked) does not have."""
    return HookCheck(tuple(hook for hook in HOOKED_METHODS if not callable(getattr(base, hook.name, None))))
