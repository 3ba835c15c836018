"""The scheduler's state machine: start executions, advance them as tasks finish, cancel.

``advance`` runs with the workflow row locked (``SELECT … FOR UPDATE``), so
dependents of one execution are evaluated by one transaction at a time even
with several server processes applying results concurrently.
"""

from __future__ import annotations

import uuid

from django.db import transaction
from django.utils import timezone

from fleet.engine.events import TaskReadyEvent
from fleet.models import (
    TASK_TERMINAL,
    WORKFLOW_TERMINAL,
    TaskExecution,
    TaskStatus,
    Tenant,
    TriggerRule,
    WorkflowExecution,
    WorkflowStatus,
)


class SchedulingError(Exception):
    """A request the scheduler refuses (unknown workflow, bad state); ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def start_execution(
    tenant: Tenant, workflow_name: str, context: dict, priority: int = 0
) -> WorkflowExecution:
    """Create an execution of the tenant's active package for ``workflow_name``; roots become Ready."""
    from artifacts.services import active_package

    package = active_package(tenant, workflow_name)
    if package is None:
        raise SchedulingError(
            f"no active package provides workflow {workflow_name!r} in this tenant", 404
        )
    now = timezone.now()
    tasks = package.manifest["tasks"]
    with transaction.atomic():
        execution = WorkflowExecution.objects.create(
            tenant=tenant,
            package=package,
            workflow_name=workflow_name,
            input_context=context,
            priority=priority,
        )
        TaskExecution.objects.bulk_create(
            [_task_row(execution, spec, position, now) for position, spec in enumerate(tasks)]
        )
    return execution


def _task_row(execution: WorkflowExecution, spec: dict, position: int, now) -> TaskExecution:
    root = not spec.get("dependencies")
    routing = {k: spec[k] for k in ROUTING_KEYS if spec.get(k) not in (None, [], "")}
    return TaskExecution(
        workflow_execution=execution,
        tenant_id=execution.tenant_id,
        task_id=spec["id"],
        function=spec["function"],
        dependencies=list(spec.get("dependencies") or []),
        trigger_rule=spec.get("trigger_rule") or TriggerRule.ALL_SUCCESS,
        position=position,
        status=TaskStatus.READY if root else TaskStatus.NOT_STARTED,
        ready_at=now if root else None,
        max_retries=int(spec.get("retries") or 0),
        retry_backoff_s=float(spec.get("retry_backoff_s") or 0.0),
        timeout_s=float(spec.get("timeout_s") or 300.0),
        routing=routing,
        priority=int(spec.get("priority") or 0) + execution.priority,
    )


ROUTING_KEYS = (
    "agent", "tags", "capability", "min_free_memory_mb", "min_free_cpu_pct",
    "gpu", "min_free_vram_pct", "group", "affinity",
)  # fmt: skip


def rule_outcome(rule: str, dependency_states: list[str]) -> str | None:
    """Ready, Skipped, or None (not decidable yet) for a task whose dependencies are in these states."""
    if not all(state in TASK_TERMINAL for state in dependency_states):
        return None
    if rule == TriggerRule.ALL_DONE:
        return TaskStatus.READY
    if rule == TriggerRule.ONE_FAILED:
        return TaskStatus.READY if TaskStatus.FAILED in dependency_states else TaskStatus.SKIPPED
    return (
        TaskStatus.READY
        if all(s == TaskStatus.COMPLETED for s in dependency_states)
        else TaskStatus.SKIPPED
    )


def advance(execution: WorkflowExecution) -> list[TaskReadyEvent]:
    """Promote NotStarted tasks whose trigger rule is now decided; finish the workflow when all are terminal.

    Must run inside a transaction holding the workflow row lock.  Returns events
    for the tasks that became Ready, to be dispatched after commit.
    """
    tasks = {t.task_id: t for t in TaskExecution.objects.filter(workflow_execution=execution)}
    now = timezone.now()
    events: list[TaskReadyEvent] = []
    cancelled = execution.status == WorkflowStatus.CANCELLED
    changed = True
    while changed:  # a Skipped task can decide its own dependents in the same pass
        changed = False
        for task in tasks.values():
            if task.status != TaskStatus.NOT_STARTED:
                continue
            decided = (
                TaskStatus.SKIPPED
                if cancelled
                else rule_outcome(task.trigger_rule, [tasks[d].status for d in task.dependencies])
            )
            if decided is None:
                continue
            task.status = decided
            fields = {"status": decided}
            if decided == TaskStatus.READY:
                task.ready_at = fields["ready_at"] = now
                events.append(TaskReadyEvent(task.id, execution.id, task.task_id, task.attempt + 1))
            else:
                task.finished_at = fields["finished_at"] = now
            TaskExecution.objects.filter(pk=task.pk, status=TaskStatus.NOT_STARTED).update(**fields)
            changed = True
    if all(t.status in TASK_TERMINAL for t in tasks.values()):
        _finish(execution, tasks, now)
    return events


def _finish(execution: WorkflowExecution, tasks: dict, now) -> None:
    if execution.status in WORKFLOW_TERMINAL:
        return
    failed = sorted(t.task_id for t in tasks.values() if t.status == TaskStatus.FAILED)
    final = dict(execution.input_context or {})
    for task in sorted(tasks.values(), key=lambda t: t.position):
        if task.status == TaskStatus.COMPLETED:
            final.update(task.output_context or {})
    status = WorkflowStatus.FAILED if failed else WorkflowStatus.COMPLETED
    error = f"task(s) failed: {', '.join(failed)}" if failed else ""
    WorkflowExecution.objects.filter(pk=execution.pk).update(
        status=status, final_context=final, finished_at=now, error=error
    )
    execution.status = status


def cancel_execution(tenant: Tenant, execution_id: uuid.UUID) -> WorkflowExecution:
    """Cancel: nothing new starts; tasks not yet running are Skipped; running ones finish on their own."""
    from fleet.engine.outbox_ack import withdraw_undelivered

    with transaction.atomic():
        execution = (
            WorkflowExecution.objects.select_for_update()
            .filter(tenant=tenant, pk=execution_id)
            .first()
        )
        if execution is None:
            raise SchedulingError("execution not found", 404)
        if execution.status in WORKFLOW_TERMINAL:
            raise SchedulingError(f"execution is already {execution.status}", 409)
        now = timezone.now()
        TaskExecution.objects.filter(
            workflow_execution=execution, status__in=[TaskStatus.NOT_STARTED, TaskStatus.READY]
        ).update(
            status=TaskStatus.SKIPPED, finished_at=now, wait_reason="", error_message="cancelled"
        )
        withdraw_undelivered(execution.pk)
        execution.status = WorkflowStatus.CANCELLED
        execution.finished_at = now
        execution.error = "cancelled by request"
        execution.save(update_fields=["status", "finished_at", "error"])
    return execution
