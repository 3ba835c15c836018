"""Outcomes as an agent reports them: a task placed and delivered to an agent, and the
body of its result."""

from __future__ import annotations

from fleet.executors.fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox
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
