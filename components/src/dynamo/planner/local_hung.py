"""When the ``local`` connector treats a live worker process as dead: stopped (SIGSTOP, a tracer) too long.

A stopped worker keeps its process, so the connector's exit check never fires, while it answers nothing,
publishes no FPM and holds its replica: the planner would count it forever. Pure logic; the connector reads
the state letter (``/proc/<pid>/stat``) and kills.
"""

from __future__ import annotations

from dataclasses import dataclass

# Linux process states of a stopped process: ``T`` by a signal (SIGSTOP, SIGTSTP), ``t`` at a tracer's stop.
STOPPED_STATES = {"T": "stopped by a signal", "t": "stopped by a tracer"}


def stat_state(stat_line: str) -> str | None:
    """The state letter of a ``/proc/<pid>/stat`` line; None if it has none.

    The command name in parentheses may itself hold spaces and parentheses: the state follows the last ``)``.
    """
    _, paren, rest = stat_line.rpartition(")")
    fields = rest.split()
    return fields[0] if paren and fields else None


@dataclass(frozen=True)
class HungCheck:
    stopped_since: float | None  # when the process was first seen stopped (monotonic); None while it runs
    reason: str | None  # why it counts as hung, None while it does not


def check_stopped(
    state: str | None, stopped_since: float | None, now: float, hung_after_s: float
) -> HungCheck:
    """Whether a worker in ``state`` (None: unknown) is hung, given when it was first seen stopped.

    Hung: seen stopped at two readings at least ``hung_after_s`` apart and at every reading between
    (one that saw it run resets the clock). ``hung_after_s`` 0 turns the check off.
    """
    if hung_after_s <= 0 or state not in STOPPED_STATES:
        return HungCheck(None, None)
    since = now if stopped_since is None else stopped_since
    stopped_s = now - since
    if stopped_s < hung_after_s:
        return HungCheck(since, None)
    why = f"{STOPPED_STATES[state]} (state {state}) for {stopped_s:.0f} s"
    return HungCheck(since, f"{why} (local.hung_after_s {hung_after_s:g})")
