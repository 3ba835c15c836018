"""The TaskResultHandler: the one place that writes task outcomes.

Both executors hand it a :class:`TaskReport`.  It is idempotent and fenced:
only an outcome naming the task's current assignment (and, on the fleet, the
agent currently holding it) applies; anything else is recorded as ignored.
Retries with exponential backoff, context persistence and the advance of the
workflow happen here, in one transaction per outcome.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from cloacina_site.config import get_config
from fleet.engine import scheduler
from fleet.engine.context import ContextError, validate_context
from fleet.engine.events import ExecutionStatus, TaskReadyEvent
from fleet.engine.outbox_ack import ack_and_release
from fleet.models import (
    TASK_TERMINAL,
    Outcome,
    TaskExecution,
    TaskOutcome,
    TaskStatus,
    WorkflowExecution,
)

log = logging.getLogger(__name__)

# A task refused this many times in a row (wrong triple, …) fails instead of bouncing forever.
MAX_REFUSALS = 10


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


@dataclass
class Applied:
    applied: bool
    status: ExecutionStatus
    reason: str = ""
    ready: list[TaskReadyEvent] = field(default_factory=list)
    retry_at: object = None  # when a retried task becomes due, if delayed


class TaskResultHandler:
    def apply(self, report: TaskReport) -> Applied:
        """Record ``report``; apply it if it belongs to the current assignment.

        Locks, in order: the task row, its undecided dependents, and (briefly, at
        the end) the workflow row's open-task counter.  Every writer takes them in
        that order, so concurrent outcomes never deadlock.
        """
        try:
            with transaction.atomic():
                task = (
                    TaskExecution.objects.select_for_update()
                    .filter(pk=report.task_execution_id)
                    .first()
                )
                if task is None:
                    return Applied(False, ExecutionStatus.SUPERSEDED, "unknown task execution")
                stale = self._stale_reason(task, report)
                if stale:
                    self._record(task, report, applied=False, reason=stale)
                    return Applied(False, ExecutionStatus.SUPERSEDED, stale)
                report = self._checked_output(report)
                self._record(task, report, applied=True)
                result = self._apply(task, report)
                if task.status in TASK_TERMINAL:
                    ready, skipped = scheduler.settle(task)
                    result.ready = ready + result.ready
                    scheduler.close_tasks(task.workflow_execution_id, 1 + skipped)
                # Last before the commit: the agent's row (its slot counter) stays locked
                # only for the commit, not the whole outcome; every dispatch, result and
                # heartbeat of that agent waits on that lock.
                ack_and_release(task.pk, task.assignment)
                return result
        except IntegrityError:
            # A concurrent duplicate of the same outcome won the unique (task, assignment, applied) race.
            return Applied(False, ExecutionStatus.SUPERSEDED, "duplicate outcome")

    @staticmethod
    def _stale_reason(task: TaskExecution, report: TaskReport) -> str:
        if task.status != TaskStatus.RUNNING:
            return f"task is {task.status}, not Running"
        if task.assignment != report.assignment:
            return f"assignment {report.assignment} is not current ({task.assignment})"
        if report.agent_id is not None and task.agent_id != report.agent_id:
            return "the task is no longer assigned to this agent"
        return ""

    @staticmethod
    def _checked_output(report: TaskReport) -> TaskReport:
        if report.outcome != Outcome.SUCCESS:
            return report
        output = {} if report.output is None else report.output
        try:
            validate_context(output, get_config().max_context_bytes, what="task output")
        except ContextError as exc:
            return TaskReport(
                report.task_execution_id, report.assignment, Outcome.FAILURE,
                error_type="InvalidTaskOutput", error_message=str(exc),
                agent_id=report.agent_id, agent_name=report.agent_name,
            )  # fmt: skip
        return TaskReport(**{**report.__dict__, "output": output})

    @staticmethod
    def _record(task: TaskExecution, report: TaskReport, applied: bool, reason: str = "") -> None:
        TaskOutcome.objects.create(
            task=task, assignment=report.assignment, attempt=task.attempt, outcome=report.outcome,
            applied=applied, ignored_reason=reason[:200], agent_name=report.agent_name[:200],
            error_type=report.error_type[:200], error_message=report.error_message[:10000],
        )  # fmt: skip

    def _apply(self, task: TaskExecution, report: TaskReport) -> Applied:
        now = timezone.now()
        if report.outcome == Outcome.SUCCESS:
            task.status, task.output_context, task.finished_at = (
                TaskStatus.COMPLETED,
                report.output,
                now,
            )
            task.error_type = task.error_message = task.traceback = ""
            task.save(
                update_fields=[
                    "status",
                    "output_context",
                    "finished_at",
                    "error_type",
                    "error_message",
                    "traceback",
                ]
            )
            return Applied(True, ExecutionStatus.COMPLETED)
        if report.outcome == Outcome.REFUSED:
            return self._requeue_refused(task, report)
        return self._fail_or_retry(task, report, now)

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
        event = TaskReadyEvent(task.id, task.workflow_execution_id, task.task_id, task.attempt + 1)
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
        if task.attempt <= task.max_retries and execution_status != "Cancelled":
            delay = task.retry_backoff_s * (2 ** (task.attempt - 1))
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
                        task.id, task.workflow_execution_id, task.task_id, task.attempt + 1
                    )
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
