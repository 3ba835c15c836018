"""Helpers for the fleet's tests: agents in the roster, a small package, executions.

Agents made here are rows only (no process): ``connected=True`` marks them as
holding a delivery socket on this test process, which is what dispatch needs.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from agents.protocol.triples import host_triple
from tests.factories import make_package, start

NOOP_SOURCE = """
def a(context):
    return {"a": 1}

def b(context):
    return {"b": context.get("a", 0) + 1}
"""


@pytest.fixture(autouse=True)
def _close_delivery_pool():
    """The delivery pool's threads keep connections; close them so the test DB can go."""
    yield
    from fleet.delivery import db as delivery_db

    delivery_db.close()


@pytest.fixture
def short_liveness():
    """Agents are dead after 1.5 s without a beat (0.5 s × 3), for the sweeps under test."""
    from cloacina_site.config import apply_overrides, reset_config

    apply_overrides(heartbeat_interval_s=0.5, liveness_misses=3)
    yield
    reset_config()


def make_agent(
    tenant,
    name: str | None = None,
    max_concurrency: int = 2,
    connected: bool = True,
    state: str = "live",
    triple: str | None = None,
    heartbeat_age_s: float = 0.0,
    in_flight: int = 0,
):
    from agents.models import Agent
    from fleet.delivery import local_sockets

    return Agent.objects.create(
        tenant=tenant,
        name=name or f"agent-{uuid.uuid4().hex[:6]}",
        state=state,
        target_triple=triple or host_triple(),
        max_concurrency=max_concurrency,
        in_flight=in_flight,
        connected_to=local_sockets.server_id() if connected else "",
        last_heartbeat=timezone.now() - timedelta(seconds=heartbeat_age_s),
    )


def two_task_package(tenant, name: str = "demo", workflow: str = "demo", **task_extra):
    """Package ``demo``: root ``a`` (with ``task_extra`` keys) and ``b`` depending on it."""
    return make_package(
        tenant,
        [
            {"id": "a", "function": "demo.steps:a", **task_extra},
            {"id": "b", "function": "demo.steps:b", "dependencies": ["a"]},
        ],
        NOOP_SOURCE,
        name=name,
        workflow=workflow,
    )


def ready_root(tenant, context: dict | None = None, workflow: str = "demo"):
    """Start an execution; return (execution, its Ready root task ``a``)."""
    execution, tasks = start(tenant, workflow, context or {})
    return execution, tasks["a"]
