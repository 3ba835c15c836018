"""The TaskResultHandler: the one place that writes task outcomes.

Both executors hand it a :class:`TaskReport`.  It is idempotent and fenced:
only an outcome naming the task's current assignment (and, on the fleet, the
agent currently holding it) applies; anything else is recorded as ignored.
Retries with exponential backoff, context persistence and the advance of the
workflow happen here, in one transaction per outcome.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import NamedTuple

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from agents.sandbox.task_log import TaskLog
from fleet.engine import hooks, scheduler, task_logs
from fleet.engine.context import ContextError, encode_context, storable_text, validate_context
from fleet.engine.events import ExecutionStatus, TaskReadyEvent
from fleet.models import (
    TASK_TERMINAL,
    Outcome,
    TaskExecution,
    TaskStatus,
    WorkflowExecution,
)
from fleet.platform.config import get_config

log = logging.getLogger(__name__)

# A task refused this many times in a row (wrong triple, …) fails instead of bouncing forever.
MAX_REFUSALS = 10
# Exponential backoff is capped: retry_backoff_s × 2^(attempt-1) overflows a timedelta
# long before a manifest's retry limit.
MAX_RETRY_DELAY_S = 24 * 3600.0


@dataclass(frozen=True)
class TaskReport:
    task_execution_id: uuid.UUID
    assignment: int
    outcome: str  # an Outcome value
    output: object = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    agent_id: uuid.UUID | None = None  # set by the fleet: the reporting agent must hold the task
    agent_name: str = ""
    # False: a failure no retry could change (e.g. no agent could ever run the task).
    retryable: bool = True
    log: TaskLog | None = None  # what the attempt printed (bounded), when it ran


@dataclass
class Applied:
    applied: bool
    status: ExecutionStatus
    reason: str = ""
    ready: list[TaskReadyEvent] = field(default_factory=list)
    retry_at: object = None  # when a retried task becomes due, if delayed


def _storable(report: TaskReport) -> TaskReport:
    """An error text holding NUL (or a lone surrogate) would make the whole outcome
    unstorable; the text is kept, those characters replaced."""
    texts = {
        name: storable_text(getattr(report, name))
        for name in ("error_type", "error_message", "traceback", "agent_name")
    }
    if all(texts[name] == getattr(report, name) for name in texts):
        return report
    return replace(report, **texts)


class TaskHead(NamedTuple):
    """The columns an outcome is fenced and routed by (read under the row lock)."""

    id: uuid.UUID
    status: str
    assignment: int
    agent_id: uuid.UUID | None
    attempt: int
    workflow_execution_id: uuid.UUID
    task_name: str
    has_dependents: bool = True  # unknown on the slow path: look
    settled: bool = False  # counted settled and acked already (a leaf's fast path)


_LOCK_TASK = """
SELECT id, status, assignment, agent_id, attempt, workflow_execution_id, task_name
FROM fleet_taskexecution WHERE id = %s FOR UPDATE
"""
_COMPLETE = """
UPDATE fleet_taskexecution SET status = 'Completed', output_context = %s::jsonb,
    finished_at = now(), error_type = '', error_message = '', traceback = ''
WHERE id = %s
"""
_RECORD = """
INSERT INTO fleet_taskoutcome (task_execution_id, assignment, attempt, outcome, applied, ignored_reason,
    agent_name, error_type, error_message, received_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now())
"""
# Outcomes that are not applied (late, duplicate) are kept for the audit, but only so many
# per task: an agent re-posting one outcome in a loop must not grow the table without end.
MAX_UNAPPLIED_OUTCOMES_PER_TASK = 50
_RECORD_UNAPPLIED = """
INSERT INTO fleet_taskoutcome (task_execution_id, assignment, attempt, outcome, applied, ignored_reason,
    agent_name, error_type, error_message, received_at)
SELECT %s, %s, %s, %s, false, %s, %s, %s, %s, now()
WHERE (SELECT count(*) FROM fleet_taskoutcome WHERE task_execution_id = %s AND NOT applied) < %s
"""


# The rows of relation ``done`` (completed tasks), each with whether it has an undecided
# dependent (a NotStarted task of its workflow naming it): only those need their dependents
# decided; the others are settled at once.  Read in the completing statement's snapshot.
HEAD_CTE = """, head AS (
    SELECT d.*, EXISTS (
        SELECT 1 FROM fleet_taskexecution n
        WHERE n.workflow_execution_id = d.workflow_execution_id AND n.status = 'NotStarted'
          AND n.dependencies ? d.task_name
    ) AS has_dependents FROM done d
)"""

# The fast path of the commonest outcome: a success for the current assignment.
# Fence, complete and record in one statement (the UPDATE takes the row lock and
# re-checks the fence after any wait); it returns nothing when the outcome is
# stale, and the slow path then records why.  A task with no undecided dependent
# (a leaf, the commonest kind) is also settled by the same statement: the
# workflow's open-task counter lowered, and the executor's side settled by its hook
# (fleet/engine/hooks.py; the fleet's: its packet acked and its agent's slot freed, or,
# in a batch, returned for release_slots) — the locks in the usual order, task row,
# workflow row, then the hook's (packet, agent row last).  For any other task the
# statement stops after recording and the caller decides the dependents first.
_COMPLETE_CURRENT = """
WITH done AS (
    UPDATE fleet_taskexecution SET status = 'Completed', output_context = %(output)s::jsonb,
        finished_at = now(), error_type = '', error_message = '', traceback = ''
    WHERE id = %(task)s AND status = 'Running' AND assignment = %(assignment)s
      AND (%(agent)s::uuid IS NULL OR agent_id = %(agent)s::uuid)
    RETURNING id, status, assignment, agent_id, attempt, workflow_execution_id, task_name
), recorded AS (
    INSERT INTO fleet_taskoutcome (task_execution_id, assignment, attempt, outcome, applied,
        ignored_reason, agent_name, error_type, error_message, received_at)
    SELECT id, assignment, attempt, 'success', true, '', %(agent_name)s, '', '', now() FROM done
){head}, closed AS (
    UPDATE fleet_workflowexecution w SET open_tasks = GREATEST(w.open_tasks - 1, 0)
    FROM head WHERE w.id = head.workflow_execution_id AND NOT head.has_dependents
    RETURNING w.open_tasks, w.status
), settling AS (
    SELECT id AS task_execution_id, assignment FROM head WHERE NOT has_dependents
){settle}
SELECT h.*, c.open_tasks, c.status, (SELECT array_agg(holder) FROM held)
FROM head h LEFT JOIN closed c ON true
"""
# Settle the workflow's open-task counter and the executor's side of the task (the
# fleet: ack the packet, freeing its agent slot) in one statement, last before the
# commit: those rows stay locked only for the commit, and every dispatch, result and
# heartbeat of that agent waits on the agent row.  A caller that applies many outcomes
# in one transaction (:func:`deferred_slot_releases`) takes the HOLDING form: what the
# task held is returned instead of freed here, and :func:`release_slots` frees it all
# at the end.
_CLOSE_AND_ACK = """
WITH closed AS (
    UPDATE fleet_workflowexecution SET open_tasks = GREATEST(open_tasks - %(settled)s, 0)
    WHERE id = %(workflow)s AND %(settled)s > 0 RETURNING open_tasks, status
), settling AS (
    SELECT %(task)s::uuid AS task_execution_id, %(assignment)s::integer AS assignment
){settle}
SELECT c.open_tasks, c.status, (SELECT array_agg(holder) FROM held)
FROM (SELECT 1) AS one LEFT JOIN closed c ON true
"""


class _Statements(NamedTuple):
    """The hot statements with the registered settle hook's fragments folded in."""

    complete_freeing: str
    complete_holding: str
    close_freeing: str
    close_holding: str


def _build_statements() -> _Statements:
    freeing = hooks.settle_ctes("settling", release=True)
    holding = hooks.settle_ctes("settling", release=False)
    return _Statements(
        _COMPLETE_CURRENT.format(head=HEAD_CTE, settle=freeing),
        _COMPLETE_CURRENT.format(head=HEAD_CTE, settle=holding),
        _CLOSE_AND_ACK.format(settle=freeing),
        _CLOSE_AND_ACK.format(settle=holding),
    )


_statements = hooks.PerHook(_build_statements)  # built once per registered hook


_deferred = threading.local()


@contextmanager
def deferred_slot_releases() -> Iterator[list[uuid.UUID]]:
    """Within this block (one thread, one transaction) outcomes ack their packets but
    leave the agents' slot counters alone; the list collects the agents to pass to
    :func:`release_slots` before the commit.  A batch of outcomes then locks each hot
    agent row once, at its very end, in one order — not from its first outcome on."""
    agents: list[uuid.UUID] = []
    _deferred.agents = agents
    try:
        yield agents
    finally:
        _deferred.agents = None


def release_slots(agent_ids: list[uuid.UUID]) -> None:
    """Free one slot per entry of ``agent_ids`` (in the caller's transaction): the
    holders a :func:`deferred_slot_releases` block collected, freed by the settle hook."""
    hooks.release(agent_ids)


def hand_over_holders(agents: list[uuid.UUID]) -> None:
    """What settled tasks held (the hook's ``held``): collected for the batch's
    :func:`release_slots` inside a :func:`deferred_slot_releases` block, else freed now."""
    deferred = getattr(_deferred, "agents", None)
    if deferred is not None:
        deferred.extend(agents)
    else:
        release_slots(agents)


def _closed(
    head: TaskHead,
    open_tasks: int | None,
    status: str | None,
    agents: list[uuid.UUID] | None,
    deferred: list[uuid.UUID] | None,
) -> None:
    """After a close-and-ack: hand the held agents to the batch, finish the workflow if
    that was its last open task."""
    if deferred is not None:
        deferred.extend(agents or [])
    if open_tasks is not None:
        scheduler.finish_if_done(head.workflow_execution_id, open_tasks, status)


class TaskResultHandler:
    def apply(self, report: TaskReport) -> Applied:
        """Record ``report``; apply it if it belongs to the current assignment.

        Locks, in order: the task row, its undecided dependents, the workflow
        row's open-task counter, and last the agent's slot counter, each held
        only from there to the commit.  Every writer takes them in that order, so
        concurrent outcomes never deadlock.  The common case (a success) is a
        handful of raw statements: this is the hottest path of the server.
        """
        report = _storable(report)
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                report, output_json = self._checked_output(report)
                if report.outcome == Outcome.SUCCESS:
                    head = self._complete_if_current(cursor, report, output_json)
                    if head is not None:
                        self.store_log(cursor, head, report)
                        return self._settle(cursor, head, Applied(True, ExecutionStatus.COMPLETED))
                return self._apply_locked(cursor, report, output_json)
        except IntegrityError:
            # A concurrent duplicate of the same outcome won the unique (task, assignment, applied) race.
            return Applied(False, ExecutionStatus.SUPERSEDED, "duplicate outcome")

    @staticmethod
    def prepare(report: TaskReport) -> tuple[TaskReport, str]:
        """The report as :meth:`apply` applies it (storable texts; a bad output turned into
        a failure) and its output's JSON text (empty unless a success)."""
        return TaskResultHandler._checked_output(_storable(report))

    @staticmethod
    def _complete_if_current(cursor, report: TaskReport, output_json: str) -> TaskHead | None:
        deferred = getattr(_deferred, "agents", None)
        statements = _statements()
        cursor.execute(
            statements.complete_freeing if deferred is None else statements.complete_holding,
            {
                "output": output_json, "task": report.task_execution_id,
                "assignment": report.assignment, "agent": report.agent_id,
                "agent_name": report.agent_name[:200],
            },
        )  # fmt: skip
        row = cursor.fetchone()
        if row is None:
            return None
        head = TaskHead(*row[:7], has_dependents=row[7], settled=not row[7])
        if head.settled:  # a leaf: the statement closed it (see _COMPLETE_CURRENT)
            _closed(head, *row[8:11], deferred)
        return head

    def _apply_locked(self, cursor, report: TaskReport, output_json: str) -> Applied:
        """Every case but a current success: lock the row, fence, record, apply."""
        cursor.execute(_LOCK_TASK, [report.task_execution_id])
        row = cursor.fetchone()
        if row is None:
            return Applied(False, ExecutionStatus.SUPERSEDED, "unknown task execution")
        head = TaskHead(*row)
        stale = self._stale_reason(head, report)
        if stale:
            self._record(cursor, head, report, applied=False, reason=stale)
            return Applied(False, ExecutionStatus.SUPERSEDED, stale)
        self._record(cursor, head, report, applied=True)
        self.store_log(cursor, head, report)
        if report.outcome == Outcome.SUCCESS:  # only reached when racing a reassignment
            cursor.execute(_COMPLETE, [output_json, head.id])
            return self._settle(cursor, head, Applied(True, ExecutionStatus.COMPLETED))
        task = TaskExecution.objects.get(pk=head.id)  # locked above
        result = self._apply_unsuccessful(task, report)
        if task.status in TASK_TERMINAL:
            return self._settle(cursor, head, result)
        self._close_and_ack(cursor, head, settled=0)
        return result

    def _settle(self, cursor, head: TaskHead, result: Applied) -> Applied:
        """The task reached a terminal state: decide its dependents, count it settled, ack."""
        if head.settled:
            return result
        skipped = 0
        if head.has_dependents:
            ready, skipped = scheduler.settle(head)
            result.ready = ready + result.ready
        self._close_and_ack(cursor, head, settled=1 + skipped)
        return result

    @staticmethod
    def _close_and_ack(cursor, head: TaskHead, settled: int) -> None:
        params = {"settled": settled, "workflow": head.workflow_execution_id,
                  "task": head.id, "assignment": head.assignment}  # fmt: skip
        deferred = getattr(_deferred, "agents", None)
        statements = _statements()
        cursor.execute(
            statements.close_freeing if deferred is None else statements.close_holding, params
        )
        open_tasks, status, agents = cursor.fetchone()
        _closed(head, open_tasks, status, agents, deferred)

    @staticmethod
    def store_log(cursor, head: TaskHead, report: TaskReport) -> None:
        """The applied attempt's log and traceback, when it left any (a refusal never ran)."""
        if report.outcome != Outcome.REFUSED and task_logs.has_content(
            report.log, report.traceback
        ):
            task_logs.store_final(
                cursor, head.id, head.attempt, head.assignment, report.log, report.traceback
            )

    @staticmethod
    def _stale_reason(task: TaskHead, report: TaskReport) -> str:
        if task.status != TaskStatus.RUNNING:
            return f"task is {task.status}, not Running"
        if task.assignment != report.assignment:
            return f"assignment {report.assignment} is not current ({task.assignment})"
        if report.agent_id is not None and task.agent_id != report.agent_id:
            return "the task is no longer assigned to this agent"
        return ""

    @staticmethod
    def _checked_output(report: TaskReport) -> tuple[TaskReport, str]:
        """The report (a bad output turned into a failure) and the output's JSON text."""
        if report.outcome != Outcome.SUCCESS:
            return report, ""
        output = {} if report.output is None else report.output
        try:
            validate_context(output, get_config().max_context_bytes, what="task output")
        except ContextError as exc:
            failure = TaskReport(
                report.task_execution_id, report.assignment, Outcome.FAILURE,
                error_type="InvalidTaskOutput", error_message=str(exc),
                agent_id=report.agent_id, agent_name=report.agent_name, log=report.log,
            )  # fmt: skip
            return failure, ""
        return TaskReport(**{**report.__dict__, "output": output}), encode_context(output)

    @staticmethod
    def _record(
        cursor, task: TaskHead, report: TaskReport, applied: bool, reason: str = ""
    ) -> None:
        if not applied:
            cursor.execute(
                _RECORD_UNAPPLIED,
                [
                    task.id, report.assignment, task.attempt, report.outcome, reason[:200],
                    report.agent_name[:200], report.error_type[:200], report.error_message[:10000],
                    task.id, MAX_UNAPPLIED_OUTCOMES_PER_TASK,
                ],
            )  # fmt: skip
            return
        cursor.execute(
            _RECORD,
            [
                task.id, report.assignment, task.attempt, report.outcome, applied, reason[:200],
                report.agent_name[:200], report.error_type[:200], report.error_message[:10000],
            ],
        )  # fmt: skip

    def _apply_unsuccessful(self, task: TaskExecution, report: TaskReport) -> Applied:
        if report.outcome == Outcome.REFUSED:
            return self._requeue_refused(task, report)
        return self._fail_or_retry(task, report, timezone.now())

    @staticmethod
    def _requeue_refused(task: TaskExecution, report: TaskReport) -> Applied:
        task.refusals += 1
        if task.refusals >= MAX_REFUSALS:
            task.status, task.finished_at = TaskStatus.FAILED, timezone.now()
            task.error_type = "Refused"
            task.error_message = (
                f"refused {task.refusals} times; last reason: {report.error_message}"
            )
            task.save(
                update_fields=["status", "finished_at", "error_type", "error_message", "refusals"]
            )
            return Applied(True, ExecutionStatus.FAILED, task.error_message)
        # A refusal is not the task's failure: back to Ready without using an attempt.
        task.status, task.attempt, task.agent = TaskStatus.READY, max(task.attempt - 1, 0), None
        task.wait_reason = f"refused by {report.agent_name or 'agent'}: {report.error_message}"
        task.ready_at, task.claimed_by, task.result_deadline = timezone.now(), "", None
        task.save(
            update_fields=[
                "status",
                "attempt",
                "agent",
                "wait_reason",
                "ready_at",
                "claimed_by",
                "result_deadline",
                "refusals",
            ]
        )
        event = TaskReadyEvent(
            task.id, task.workflow_execution_id, task.task_name, task.attempt + 1,
            task.tenant_id, task.priority,
        )  # fmt: skip
        return Applied(True, ExecutionStatus.REQUEUED, task.wait_reason, ready=[event])

    @staticmethod
    def _fail_or_retry(task: TaskExecution, report: TaskReport, now) -> Applied:
        task.error_type = report.error_type or report.outcome
        task.error_message = report.error_message
        task.traceback = report.traceback[:20000]
        execution_status = (
            WorkflowExecution.objects.filter(pk=task.workflow_execution_id)
            .values_list("status", flat=True)
            .first()
        )
        if (
            report.retryable
            and task.attempt <= task.max_retries
            and execution_status != "Cancelled"
        ):
            delay = min(task.retry_backoff_s * (2 ** (task.attempt - 1)), MAX_RETRY_DELAY_S)
            task.status, task.ready_at = TaskStatus.READY, now + timedelta(seconds=delay)
            task.claimed_by, task.result_deadline, task.agent = "", None, None
            task.wait_reason = (
                f"retry {task.attempt + 1} of {task.max_retries + 1} after {delay:g}s"
            )
            task.save(
                update_fields=[
                    "status",
                    "ready_at",
                    "claimed_by",
                    "result_deadline",
                    "agent",
                    "wait_reason",
                    "error_type",
                    "error_message",
                    "traceback",
                ]
            )
            ready = (
                []
                if delay > 0
                else [
                    TaskReadyEvent(
                        task.id,
                        task.workflow_execution_id,
                        task.task_name,
                        task.attempt + 1,
                        task.tenant_id,
                        task.priority,
                    )  # fmt: skip
                ]
            )
            return Applied(
                True, ExecutionStatus.RETRY, task.error_message, ready=ready, retry_at=task.ready_at
            )
        task.status, task.finished_at = TaskStatus.FAILED, now
        task.save(
            update_fields=["status", "finished_at", "error_type", "error_message", "traceback"]
        )
        return Applied(True, ExecutionStatus.FAILED, task.error_message)


result_handler = TaskResultHandler()
