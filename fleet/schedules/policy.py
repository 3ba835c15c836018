"""The schedule policies as pure functions: which due fire times run (catchup) and what a
run does while the schedule's previous execution is unfinished (overlap).

No database here: the firing tick (:mod:`fleet.schedules.firing`) feeds these the due
fire times and what it read, and writes what they decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from fleet.models import Catchup, Overlap


@dataclass(frozen=True)
class Planned:
    """One due fire time and whether it runs (False: it is recorded as missed)."""

    fire_time: datetime
    run: bool


def plan_catchup(
    due: list[datetime],
    now: datetime,
    policy: str,
    grace_s: float,
    catchup_max: int,
    truncated: bool = False,
) -> list[Planned]:
    """Decide each due fire time (oldest first) of one schedule.

    A fire time at most ``grace_s`` old is on time and always runs.  Older ones passed
    while no server could fire them (downtime); the ``catchup`` policy decides:

    - ``skip``: none of them runs; each is recorded missed.
    - ``latest``: the most recent due time runs (an on-time one, else the newest late
      one); the older late ones are missed.
    - ``all``: the newest ``catchup_max`` late ones run, older ones are missed.

    ``truncated`` says more fire times are due after these (a backlog longer than one
    tick reads): then each of these is older than a due time still to come, so none is
    the latest and under every policy they are all missed.
    """
    if truncated:
        return [Planned(t, False) for t in due]
    late = [t for t in due if (now - t).total_seconds() > grace_s]
    if not late:
        return [Planned(t, True) for t in due]
    if policy == Catchup.ALL:
        running = set(late[-catchup_max:]) if catchup_max > 0 else set()
    elif policy == Catchup.LATEST:
        running = {due[-1]}
    else:
        running = set()
    return [Planned(t, t in running or t not in late) for t in due]


class OverlapAction(Enum):
    START = "start"
    SKIP = "skip"  # record skipped_overlap
    CANCEL_THEN_START = "cancel_then_start"


def overlap_action(policy: str, previous_unfinished: bool) -> OverlapAction:
    """What a run does given the schedule's overlap policy and whether an execution it
    started before is still unfinished."""
    if not previous_unfinished or policy == Overlap.ALLOW:
        return OverlapAction.START
    if policy == Overlap.SKIP:
        return OverlapAction.SKIP
    return OverlapAction.CANCEL_THEN_START
