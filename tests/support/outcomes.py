"""Outcomes as an agent reports them: a task placed and delivered to an agent, and the
body of its result."""

from __future__ import annotations

from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.result_intake import ResultIn
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.factories import ready_root


def delivered_task(tenant, agent):
    """Place a fresh execution's root task and mark its outbox row delivered: (task, row)."""
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    DeliveryOutbox.objects.filter(pk=row.pk).update(state="delivered")
    return task, row


def result_body(task, row, **extra) -> dict:
    """A successful result for ``row``'s delivery of ``task`` (``extra`` overrides)."""
    return {
        "outbox_id": row.id,
        "task_execution_id": str(task.pk),
        "assignment": row.assignment,
        "outcome": "success",
        "output": {"a": 1},
        **extra,
    }


def delivered_tasks(execution) -> list:
    """Place every Ready task of ``execution`` and mark their outbox rows delivered:
    [(task, row)], in the tasks' order."""
    out = []
    for task in TaskExecution.objects.filter(workflow_execution=execution, status="Ready"):
        place_task(task.pk, "s")
        row = DeliveryOutbox.objects.get(task_execution=task)
        DeliveryOutbox.objects.filter(pk=row.pk).update(state="delivered")
        out.append((task, row))
    return out


def result_in(task, row, **extra) -> ResultIn:
    """A successful result for ``row``'s delivery of ``task``, output ``{task name: 1}``,
    as the intake receives it (``extra`` overrides)."""
    body = {
        "outbox_id": row.id,
        "task_execution_id": task.pk,
        "assignment": row.assignment,
        "outcome": "success",
        "output": {task.task_name: 1},
    }
    return ResultIn(**{**body, **extra})
