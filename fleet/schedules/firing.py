"""The firing tick: every server, every CLOACINA_SCHEDULE_TICK_S, fires the due schedules.

Exactly once per fire time, across replicas, restarts and downtime:

- Due schedules are claimed with ``SELECT … FOR UPDATE SKIP LOCKED``: two servers
  ticking at once take disjoint rows, and a row whose ``next_fire_at`` another server
  just advanced no longer matches once its lock is released.
- In ONE transaction per batch: every fire row is inserted (``ON CONFLICT DO NOTHING``
  on the unique (schedule, fire_time)), the executions of the inserted ones are
  created, the fire rows name them, and ``next_fire_at`` moves past the handled times.
  A crash or a database restart anywhere before the commit leaves nothing behind, and
  the next tick (on any server) fires the same times again; after the commit the
  unique row stops any second execution of a fire time.

What runs is decided by :mod:`fleet.schedules.policy` (catchup and overlap).
"""

from __future__ import annotations

import json
import logging
from collections import Counter as Tally
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache

from django.db import connection, transaction
from django.utils import timezone

from artifacts.models import WorkflowPackage
from artifacts.store.queries import active_package
from fleet.engine import ready_queue, scheduler
from fleet.engine.events import TaskReadyEvent
from fleet.engine.executor import PeriodicJob
from fleet.executors.fleet.routing import fairness
from fleet.models import FireOutcome, Tenant, WorkflowExecution
from fleet.platform.chunked_delete import delete_in_chunks
from fleet.platform.config import Config, get_config
from fleet.platform.cron import Cron, CronError, parse_cron
from fleet.platform.errors import DomainError
from fleet.schedules import metrics
from fleet.schedules.policy import OverlapAction, overlap_action, plan_catchup

log = logging.getLogger(__name__)

JOB_NAME = "schedule_fire"
PRUNE_JOB_NAME = "schedule_fire_prune"
BATCH = 500  # schedules claimed per transaction
DUE_PER_TICK = 1000  # fire times one schedule handles per tick (a longer backlog: next tick)
MISSED_DETAIL = "no server fired it within CLOACINA_SCHEDULE_GRACE_S (the catchup policy)"

_CLAIM = """
SELECT id, tenant_id, workflow, cron, timezone, context, catchup, overlap, next_fire_at
FROM fleet_schedule
WHERE enabled AND next_fire_at <= %s
ORDER BY next_fire_at, id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
# Schedules (of those claimed) with an execution still Pending or Running: read from the
# executions' side, where the (tenant, status) index makes unfinished ones cheap to find.
_UNFINISHED = """
SELECT f.schedule_id, e.id FROM fleet_workflowexecution e
JOIN fleet_schedulefire f ON f.execution_id = e.id
WHERE e.tenant_id = ANY(%s) AND e.status IN ('Pending', 'Running') AND f.schedule_id = ANY(%s)
"""
_INSERT_FIRES = """
INSERT INTO fleet_schedulefire (schedule_id, fire_time, outcome, execution_id, detail, at)
SELECT r.schedule_id, r.fire_time, r.outcome, NULL, r.detail, %s
FROM jsonb_to_recordset(%s::jsonb) AS r(
    schedule_id uuid, fire_time timestamptz, outcome text, detail text)
ON CONFLICT (schedule_id, fire_time) DO NOTHING
RETURNING schedule_id, fire_time
"""
_SET_FIRE_RESULTS = """
UPDATE fleet_schedulefire f SET outcome = r.outcome, execution_id = r.execution_id,
    detail = r.detail
FROM jsonb_to_recordset(%s::jsonb) AS r(
    schedule_id uuid, fire_time timestamptz, outcome text, execution_id uuid, detail text)
WHERE f.schedule_id = r.schedule_id AND f.fire_time = r.fire_time
"""
_ADVANCE = """
UPDATE fleet_schedule s SET next_fire_at = r.next_fire_at,
    last_fire_at = GREATEST(s.last_fire_at, r.last_fire_at)
FROM jsonb_to_recordset(%s::jsonb) AS r(id uuid, next_fire_at timestamptz, last_fire_at timestamptz)
WHERE s.id = r.id
"""


@dataclass
class FireReport:
    """What one tick did: schedules claimed and fire rows written, by outcome."""

    claimed: int = 0
    outcomes: Tally = field(default_factory=Tally)
    executions: list = field(default_factory=list)

    def add(self, other: FireReport) -> None:
        self.claimed += other.claimed
        self.outcomes.update(other.outcomes)
        self.executions.extend(other.executions)


@dataclass
class _Fire:
    """One fire row to write, and for a run the execution it starts."""

    schedule: dict
    fire_time: datetime
    outcome: str
    detail: str = ""
    cancel_first: bool = False
    execution: WorkflowExecution | None = None


@lru_cache(maxsize=4096)
def cron_for(expression: str, zone: str) -> Cron:
    """The parsed expression (cached: the tick reads the same few thousand every second)."""
    return parse_cron(expression, zone)


def fire_due(now: datetime | None = None, batch: int = BATCH) -> FireReport:
    """Fire every schedule due at ``now`` (default: the clock), batch by batch."""
    total = FireReport()
    while True:
        report = _fire_batch(now or timezone.now(), batch)
        total.add(report)
        if report.claimed < batch:
            return total


def _fire_batch(now: datetime, batch: int) -> FireReport:
    config = get_config()
    report = FireReport()
    roots: list[TaskReadyEvent] = []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_CLAIM, [now, batch])
        columns = [c.name for c in cursor.description]
        schedules = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        report.claimed = len(schedules)
        if not schedules:
            return report
        unfinished = _unfinished(cursor, schedules)
        fires, advances, memo = [], [], {}
        for schedule in schedules:
            planned, advance = _plan(schedule, now, config, unfinished, memo)
            fires += planned
            advances.append(advance)
        inserted = _insert_fires(cursor, fires, now)
        new_fires = [f for f in fires if (f.schedule["id"], f.fire_time) in inserted]
        roots = _start_runs(cursor, new_fires, unfinished)
        cursor.execute(_ADVANCE, [json.dumps(advances, default=str)])
    # Committed: the executions exist for everyone from now.  Count, time (fire time to
    # commit) and hand the roots to the dispatch loop's fast path.
    committed = timezone.now()
    for fire in new_fires:
        report.outcomes[fire.outcome] += 1
        metrics.FIRES.labels(fire.outcome).inc()
        if fire.execution is not None:
            report.executions.append(fire.execution.pk)
            lag = (committed - fire.fire_time).total_seconds()
            metrics.FIRE_LAG.observe(max(lag, 0.0))
    ready_queue.submit(roots)
    return report


def _unfinished(cursor, schedules: list[dict]) -> dict:
    """{schedule id: [its unfinished execution ids]} for the schedules whose overlap
    policy asks (``allow`` never needs to know)."""
    watched = [s for s in schedules if s["overlap"] != "allow"]
    if not watched:
        return {}
    cursor.execute(
        _UNFINISHED,
        [sorted({s["tenant_id"] for s in watched}), [s["id"] for s in watched]],
    )
    unfinished: dict = {}
    for schedule_id, execution_id in cursor.fetchall():
        unfinished.setdefault(schedule_id, []).append(execution_id)
    return unfinished


def _next(cron: Cron, after: datetime, memo: dict) -> datetime | None:
    """``cron.next_after(after)``, remembered for the batch: schedules sharing an expression
    and a fire time (every "0 * * * *" of a platform) compute it once."""
    key = (cron.expression, cron.timezone.key, after)
    if key not in memo:
        memo[key] = cron.next_after(after)
    return memo[key]


def _plan(
    schedule: dict, now: datetime, config: Config, unfinished: dict, memo: dict
) -> tuple[list[_Fire], dict]:
    """The fire rows of one claimed schedule and its advanced ``next_fire_at``."""
    first = schedule["next_fire_at"]
    try:
        cron = cron_for(schedule["cron"], schedule["timezone"])
    except CronError as exc:  # stored before a rule tightened: never fire it, say why
        log.warning("schedule %s has an unusable expression: %s", schedule["id"], exc)
        fire = _Fire(schedule, first, FireOutcome.FAILED_TO_START, str(exc)[:300])
        return [fire], {"id": schedule["id"], "next_fire_at": None, "last_fire_at": first}
    due = [first]
    following = _next(cron, first, memo)
    while following is not None and following <= now and len(due) < DUE_PER_TICK:
        due.append(following)
        following = _next(cron, following, memo)
    truncated = following is not None and following <= now
    plans = plan_catchup(
        due, now, schedule["catchup"], config.schedule_grace_s,
        min(config.schedule_catchup_max, DUE_PER_TICK), truncated,
    )  # fmt: skip
    busy = bool(unfinished.get(schedule["id"]))
    fires = []
    for planned in plans:
        if not planned.run:
            fires.append(_Fire(schedule, planned.fire_time, FireOutcome.MISSED, MISSED_DETAIL))
            continue
        action = overlap_action(schedule["overlap"], busy)
        if action is OverlapAction.SKIP:
            fires.append(
                _Fire(
                    schedule,
                    planned.fire_time,
                    FireOutcome.SKIPPED_OVERLAP,
                    "the previous execution is unfinished",
                )
            )
            continue
        fires.append(
            _Fire(
                schedule,
                planned.fire_time,
                FireOutcome.STARTED,
                cancel_first=action is OverlapAction.CANCEL_THEN_START,
            )
        )
        busy = True  # the run started here is unfinished for the next due time
    advance = {"id": schedule["id"], "next_fire_at": following, "last_fire_at": due[-1]}
    return fires, advance


def _insert_fires(cursor, fires: list[_Fire], now: datetime) -> set:
    """Insert every fire row; the (schedule, fire_time) pairs that were new."""
    if not fires:
        return set()
    rows = [
        {
            "schedule_id": str(f.schedule["id"]),
            "fire_time": f.fire_time.isoformat(),
            "outcome": f.outcome,
            "detail": f.detail,
        }
        for f in fires
    ]
    cursor.execute(_INSERT_FIRES, [now, json.dumps(rows)])
    return {(schedule_id, fire_time) for schedule_id, fire_time in cursor.fetchall()}


def _start_runs(cursor, fires: list[_Fire], unfinished: dict) -> list[TaskReadyEvent]:
    """Start the execution of every new ``started`` fire (cancelling first where the overlap
    policy says); a fire whose execution cannot be created becomes failed_to_start.

    The executions are created in rounds, each ONE statement: a schedule's first run of
    this tick in the first round, its second (a catch-up) in the next, and so on, so a
    ``cancel_previous`` run finds the run before it already there to cancel.
    """
    runs = [f for f in fires if f.outcome == FireOutcome.STARTED]
    if not runs:
        return []
    tenants = Tenant.objects.in_bulk({f.schedule["tenant_id"] for f in runs})
    packages: dict[tuple[int, str], WorkflowPackage | None] = {}
    backlogs: dict[int, int] = {}  # unfinished tasks per limited tenant, as this tick adds them
    roots: list[TaskReadyEvent] = []
    for round_ in _rounds(runs):
        starts, starting = [], []
        for fire in round_:
            schedule = fire.schedule
            tenant = tenants[schedule["tenant_id"]]
            if fire.cancel_first:
                _cancel_previous(tenant, schedule, unfinished)
            key = (tenant.pk, schedule["workflow"])
            if key not in packages:
                packages[key] = active_package(tenant, schedule["workflow"])
            refusal = (
                f"no active package provides workflow {schedule['workflow']!r}"
                if packages[key] is None
                else _over_backlog(tenant, len(packages[key].manifest["tasks"]), backlogs)
            )
            if refusal:
                fire.outcome, fire.detail = FireOutcome.FAILED_TO_START, refusal[:300]
                continue
            starts.append(
                scheduler.ExecutionStart(
                    tenant, packages[key], schedule["workflow"], _context(schedule)
                )
            )
            starting.append(fire)
        for fire, (execution, events) in zip(
            starting, scheduler.start_executions(starts) if starts else [], strict=True
        ):
            fire.execution = execution
            unfinished[fire.schedule["id"]] = [execution.pk]
            roots += events
    cursor.execute(
        _SET_FIRE_RESULTS,
        [
            json.dumps(
                [
                    {
                        "schedule_id": str(f.schedule["id"]),
                        "fire_time": f.fire_time.isoformat(),
                        "outcome": f.outcome,
                        "execution_id": str(f.execution.pk) if f.execution else None,
                        "detail": f.detail,
                    }
                    for f in runs
                ]
            )
        ],
    )
    return roots


def _over_backlog(tenant: Tenant, adding: int, backlogs: dict[int, int]) -> str:
    """Why an execution of ``adding`` tasks would take the tenant past its backlog limit
    (the bound POST /executions answers 429 for: fleet.executors.fleet.routing.fairness),
    counting what this tick already started; '' when it fits or there is no limit."""
    limit, source = fairness.max_backlog(tenant)
    if not limit:
        return ""
    if tenant.pk not in backlogs:
        backlogs[tenant.pk] = fairness.backlog(tenant)
    if backlogs[tenant.pk] + adding > limit:
        return (
            f"tenant {tenant.name!r} has {backlogs[tenant.pk]} unfinished task(s); this "
            f"execution adds {adding}, over {source} of {limit}"
        )
    backlogs[tenant.pk] += adding
    return ""


def _rounds(runs: list[_Fire]) -> list[list[_Fire]]:
    """``runs`` (each schedule's in fire-time order) as rounds: every schedule's n-th run in
    round n."""
    rounds: list[list[_Fire]] = []
    seen: dict = {}
    for fire in runs:
        index = seen.get(fire.schedule["id"], 0)
        seen[fire.schedule["id"]] = index + 1
        if index == len(rounds):
            rounds.append([])
        rounds[index].append(fire)
    return rounds


def _context(schedule: dict) -> dict:
    # Raw cursors hand jsonb back as text (Django decodes JSONField itself).
    context = schedule["context"]
    return json.loads(context) if isinstance(context, str) else dict(context or {})


def _cancel_previous(tenant: Tenant, schedule: dict, unfinished: dict) -> None:
    """Cancel the schedule's unfinished executions through the engine's cancel path."""
    for execution_id in unfinished.pop(schedule["id"], []):
        try:
            scheduler.cancel_execution(tenant, execution_id)
        except DomainError as exc:  # it finished meanwhile: nothing to cancel
            log.debug("schedule %s: previous execution not cancelled: %s", schedule["id"], exc)


# Oldest first, a bounded chunk per statement: a long-neglected table is worked down over
# several runs instead of one huge delete.
_PRUNE = """
DELETE FROM fleet_schedulefire WHERE id IN (
    SELECT id FROM fleet_schedulefire WHERE fire_time < %s ORDER BY fire_time LIMIT %s
)
"""
PRUNE_CHUNK = 10_000
PRUNE_CHUNKS_PER_RUN = 10


def prune_fires(now: datetime | None = None) -> int:
    """Delete fire rows older than CLOACINA_SCHEDULE_FIRE_RETENTION_S; how many went.

    Safe for exactly-once: a schedule's ``next_fire_at`` is already past every fire row,
    so an old row's unique key is never needed again."""
    retention = get_config().schedule_fire_retention_s
    if retention <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(seconds=retention)
    return delete_in_chunks(_PRUNE, cutoff, PRUNE_CHUNK, PRUNE_CHUNKS_PER_RUN)


def schedule_jobs(interval_s: float | None = None) -> list[PeriodicJob]:
    """For ``serve``: the firing tick on every server (not leader-only: claims are row
    locks), and the pruning of old fire rows on the leader every few minutes."""
    return [
        PeriodicJob(
            name=JOB_NAME,
            func=fire_due,
            interval_s=interval_s or get_config().schedule_tick_s,
        ),
        PeriodicJob(name=PRUNE_JOB_NAME, func=prune_fires, interval_s=300.0, leader_only=True),
    ]
