"""Re-run and retry finished executions, and their history (the one writer of ExecutionLink).

**Re-run** starts a NEW execution of the same package version the source ran (that exact
package, even if a newer version has superseded it since), with the source's input
context or an edited one.  The source must be finished (Completed, Failed or Cancelled).

**Retry** re-opens a Failed execution IN PLACE, from its failed tasks: completed tasks keep
their status and outputs (their dependents read them as before), the failed tasks and the
tasks skipped after them are decided again, and the execution is Running until it finishes
again.  Re-opening (rather than copying completed outputs into a new execution) keeps the
engine's invariants simple: one execution per set of task rows, outputs never copied, the
context builder unchanged, and the execution id a user already holds (CONTRACT.md: retry
answers 200, not 201).  What a retry changes on a task:

* ``attempt`` keeps counting the task's runs (per-attempt outcomes and logs stay apart), so
  the retry budget is renewed by raising ``max_retries`` to ``attempt`` + the manifest's
  ``retries``: the task gets its full manifest budget again.
* ``assignment`` (the fencing token) is never reset: a late outcome of the failed run stays
  stale.

Both are recorded as :class:`~fleet.models.ExecutionLink` rows (who, when, which executions),
in the same transaction as the change they record.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from fleet.engine import scheduler
from fleet.engine.events import TaskReadyEvent
from fleet.models import (
    WORKFLOW_TERMINAL,
    ExecutionLink,
    RerunKind,
    TaskExecution,
    TaskStatus,
    Tenant,
    WorkflowExecution,
    WorkflowStatus,
)
from fleet.platform.errors import DomainError, ErrorKind

# Why adding this many unfinished tasks must be refused now ('' when it may go ahead):
# the surface passes the tenant's backlog check (fleet.executors.fleet.routing.fairness).
Admission = Callable[[int], str]

REOPENED = (TaskStatus.FAILED, TaskStatus.SKIPPED)
# The columns a retry resets on each re-opened task (besides status and the retry budget).
_RESET_COLUMNS = [
    "status", "max_retries", "ready_at", "started_at", "finished_at", "claimed_by",
    "claimed_at", "result_deadline", "agent", "refusals", "wait_reason", "output_context",
    "error_type", "error_message", "traceback",
]  # fmt: skip


class RerunError(DomainError):
    """A re-run or retry the engine refuses: unknown execution, not finished, nothing failed."""


@dataclass(frozen=True)
class Retried:
    execution: WorkflowExecution
    tasks: list[str]  # the re-opened tasks, in manifest order
    ready: list[TaskReadyEvent]  # the events of those Ready at once


@dataclass(frozen=True)
class TaskState:
    """What the retry plan needs of one task."""

    name: str
    dependencies: Sequence[str]
    trigger_rule: str
    status: str


def _execution(tenant: Tenant, execution_id: uuid.UUID) -> WorkflowExecution:
    execution = (
        WorkflowExecution.objects.select_related("package")
        .filter(tenant=tenant, pk=execution_id)
        .first()
    )
    if execution is None:
        raise RerunError(ErrorKind.NOT_FOUND, f"execution {execution_id} not found")
    return execution


def _record(
    kind: str, source: WorkflowExecution, execution: WorkflowExecution, actor: str, **fields
) -> ExecutionLink:
    """The history row of a re-run or retry (inside the transaction of the change)."""
    return ExecutionLink.objects.create(
        tenant_id=source.tenant_id, kind=kind, source=source, execution=execution,
        actor=actor[:200], **fields,
    )  # fmt: skip


def _admit(admit: Admission | None, adding: int) -> None:
    refusal = admit(adding) if admit else ""
    if refusal:
        raise RerunError(ErrorKind.LIMITED, refusal)


def rerun_execution(
    tenant: Tenant,
    execution_id: uuid.UUID,
    actor: str,
    context: dict | None = None,
    admit: Admission | None = None,
) -> tuple[WorkflowExecution, list[TaskReadyEvent]]:
    """A new execution of the source's package version with ``context`` (None: the source's
    input, unchanged); returns it and the events of its root tasks (submit them after commit)."""
    source = _execution(tenant, execution_id)
    if source.status not in WORKFLOW_TERMINAL:
        raise RerunError(
            ErrorKind.CONFLICT,
            f"execution {source.pk} is {source.status}: only a finished execution can be "
            "re-run (wait for it, or cancel it first)",
        )
    _admit(admit, len(source.package.manifest["tasks"]))
    new_context = source.input_context if context is None else context
    with transaction.atomic():
        execution, roots = scheduler.start_execution_with_roots(
            tenant, source.workflow_name, new_context, source.priority, package=source.package
        )
        _record(
            RerunKind.RERUN,
            source,
            execution,
            actor,
            at=execution.created_at,
            context_edited=context is not None and context != source.input_context,
        )
    return execution, roots


def retry_plan(tasks: Sequence[TaskState]) -> dict[str, str]:
    """Each re-opened task's new status (failed and skipped tasks are re-opened; the rest
    keep theirs): Ready when its dependencies are decided and its rule says so (a root is
    always Ready, as at start), Skipped when its rule skips it now, else NotStarted (a
    dependency is re-opened too; the scheduler decides it when that one finishes).

    Decided in dependency order (Kahn's), so a skip cascades exactly as it would at run
    time; no recursion, so a 2,000-task chain is fine.
    """
    status = {t.name: t.status for t in tasks}
    reopened = [t for t in tasks if t.status in REOPENED]
    names = {t.name for t in reopened}
    waiting_on = {t.name: {d for d in t.dependencies if d in names} for t in reopened}
    dependents: dict[str, list[str]] = {}
    for t in reopened:
        for d in waiting_on[t.name]:
            dependents.setdefault(d, []).append(t.name)
    by_name = {t.name: t for t in reopened}
    queue = deque(t.name for t in reopened if not waiting_on[t.name])
    plan: dict[str, str] = {}
    while queue:
        name = queue.popleft()
        task = by_name[name]
        states = [plan.get(d, status.get(d, TaskStatus.COMPLETED)) for d in task.dependencies]
        decided = scheduler.rule_outcome(task.trigger_rule, states) if states else None
        plan[name] = TaskStatus.READY if not states else decided or TaskStatus.NOT_STARTED
        for dependent in dependents.get(name, []):
            waiting_on[dependent].discard(name)
            if not waiting_on[dependent]:
                queue.append(dependent)
    return plan


def _retry_budget(task: TaskExecution, manifest_tasks: dict[str, dict]) -> int:
    """``max_retries`` that gives the task its manifest's retries again from its current attempt."""
    spec = manifest_tasks.get(task.task_name) or {}
    return task.attempt + int(spec.get("retries") or 0)


def retry_execution(
    tenant: Tenant, execution_id: uuid.UUID, actor: str, admit: Admission | None = None
) -> Retried:
    """Re-open a Failed execution from its failed tasks (see the module docstring)."""
    execution = _execution(tenant, execution_id)
    if execution.status != WorkflowStatus.FAILED:
        hint = " (re-run it instead)" if execution.status in WORKFLOW_TERMINAL else ""
        raise RerunError(
            ErrorKind.CONFLICT,
            f"execution {execution.pk} is {execution.status}: only a Failed execution can be "
            f"retried{hint}",
        )
    with transaction.atomic():
        # Task rows first, the workflow row last: the order outcome transactions lock them in.
        tasks = list(
            TaskExecution.objects.select_for_update()
            .filter(workflow_execution=execution)
            .order_by("id")
        )
        if not any(t.status == TaskStatus.FAILED for t in tasks):
            raise RerunError(ErrorKind.CONFLICT, f"execution {execution.pk}: no task failed")
        plan = retry_plan(
            [TaskState(t.task_name, t.dependencies, t.trigger_rule, t.status) for t in tasks]
        )
        opened = sum(1 for s in plan.values() if s != TaskStatus.SKIPPED)
        if not any(s == TaskStatus.READY for s in plan.values()):
            raise RerunError(
                ErrorKind.CONFLICT, f"execution {execution.pk}: retrying would run no task"
            )
        _admit(admit, opened)
        # Guarded on the status, so of two retries at once only one re-opens it.
        reopened = WorkflowExecution.objects.filter(
            pk=execution.pk, status=WorkflowStatus.FAILED
        ).update(
            status=WorkflowStatus.RUNNING,
            final_context=None,
            error="",
            finished_at=None,
            open_tasks=opened,
        )
        if reopened != 1:
            raise RerunError(
                ErrorKind.CONFLICT, f"execution {execution.pk} changed; look at it again"
            )
        ready = _reopen_tasks(execution, tasks, plan)
        names = [
            t.task_name for t in sorted(tasks, key=lambda t: t.position) if t.task_name in plan
        ]
        _record(RerunKind.RETRY, execution, execution, actor, tasks=names,
                previous_error=execution.error)  # fmt: skip
    execution.refresh_from_db()
    return Retried(execution, names, ready)


def _reopen_tasks(
    execution: WorkflowExecution, tasks: list[TaskExecution], plan: dict[str, str]
) -> list[TaskReadyEvent]:
    """Write the plan to the re-opened task rows; the events of the Ready ones."""
    now = timezone.now()
    manifest_tasks = {spec["id"]: spec for spec in execution.package.manifest["tasks"]}
    changed, ready = [], []
    for task in tasks:
        new_status = plan.get(task.task_name)
        if new_status is None:
            continue
        task.status = new_status
        task.max_retries = _retry_budget(task, manifest_tasks)
        task.ready_at = now if new_status == TaskStatus.READY else None
        task.finished_at = now if new_status == TaskStatus.SKIPPED else None
        task.started_at = task.claimed_at = task.result_deadline = None
        task.claimed_by = task.wait_reason = ""
        task.agent = None
        task.refusals = 0
        task.output_context = None
        task.error_type = task.error_message = task.traceback = ""
        changed.append(task)
        if new_status == TaskStatus.READY:
            ready.append(
                TaskReadyEvent(
                    task.pk,
                    execution.pk,
                    task.task_name,
                    task.attempt + 1,
                    execution.tenant_id,
                    task.priority,
                )
            )
    TaskExecution.objects.bulk_update(changed, _RESET_COLUMNS)
    return ready
