"""Helpers for the routing tests: agents with tags/capabilities/metrics, routed tasks."""

from __future__ import annotations

from fleet.executors.fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import IDLE, make_agent
from tests.support.factories import NOOP_SOURCE, make_package, start


def agent(tenant, name, **options):
    """A connected, live agent row reporting :data:`IDLE` metrics unless told otherwise."""
    return make_agent(tenant, name, **{"metrics": IDLE, **options})


def routed_package(tenant, workflow: str = "demo", tasks: list[dict] | None = None, **routing):
    """Package with root ``a`` carrying ``routing`` and ``b`` after it (or ``tasks``)."""
    tasks = tasks or [
        {"id": "a", "function": "demo.steps:a", **routing},
        {"id": "b", "function": "demo.steps:b", "dependencies": ["a"]},
    ]
    return make_package(tenant, tasks, NOOP_SOURCE, name=workflow, workflow=workflow)


def place_root(tenant, workflow: str = "demo", context: dict | None = None):
    """Start an execution and place its root ``a``: (placement result, task row)."""
    _, tasks = start(tenant, workflow, context or {})
    task = tasks["a"]
    return place_task(task.pk, "test-server"), TaskExecution.objects.get(pk=task.pk)


def placed_on(task) -> str | None:
    row = DeliveryOutbox.objects.filter(task_execution=task).select_related("agent").first()
    return row.agent.name if row else None
