"""Helpers for the routing tests: agents with tags/capabilities/metrics, routed tasks."""

from __future__ import annotations

from agents.models import Agent
from fleet.delivery.placement import place_task
from fleet.models import DeliveryOutbox, TaskExecution
from tests.factories import make_package, start
from tests.fleet_support import NOOP_SOURCE, make_agent

IDLE = {"free_cpu_pct": 90.0, "memory_free_pct": 80.0, "free_memory_mb": 8000}


def agent(tenant, name, *, tags=(), capabilities=(), metrics=None, exclusive=False, **kwargs):
    """A connected, live agent row with routing metadata (no process)."""
    row = make_agent(tenant, name, **kwargs)
    Agent.objects.filter(pk=row.pk).update(
        tags=list(tags),
        capabilities=list(capabilities),
        metrics=IDLE if metrics is None else metrics,
        exclusive=exclusive,
    )
    row.refresh_from_db()
    return row


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
