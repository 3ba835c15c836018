"""GET /metrics: the fleet totals come from the database, so every server process agrees."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from fleet.executors.fleet.delivery.metrics import RESULTS
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.delivery.wait_reasons import explain_waiting_tasks
from fleet.models import DeliveryOutbox, Eviction, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package


def scrape() -> dict[str, float]:
    text = Client().get("/metrics").content.decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.MULTILINE)
    }


@pytest.mark.django_db
def test_the_fleet_totals_are_read_from_the_database(tenant, other_tenant):
    two_task_package(tenant)
    dead = make_agent(tenant, "dead", state="dead", connected=False)
    make_agent(tenant, "live-1", max_concurrency=5)
    make_agent(other_tenant, "live-2")
    Eviction.objects.create(agent=dead, tenant=tenant, agent_name="dead", reason="x", reassigned=2)
    Eviction.objects.create(agent=dead, tenant=tenant, agent_name="dead", reason="y", reassigned=3)
    for _ in range(3):
        _, task = ready_root(tenant)
        place_task(task.pk, "s")
    DeliveryOutbox.objects.filter(pk=DeliveryOutbox.objects.order_by("id").first().pk).update(
        state="acked"
    )
    metrics = scrape()
    assert metrics["cloacina_fleet_agents_evicted_total"] == 2
    assert metrics["cloacina_fleet_work_reassigned_total"] == 5
    assert metrics["cloacina_delivery_outbox_open"] == 2
    assert metrics['cloacina_fleet_agents_live{tenant="acme"}'] == 1
    assert metrics['cloacina_fleet_agents_live{tenant="globex"}'] == 1
    assert (
        "cloacina_fleet_dispatch_latency_seconds_bucket"
        in Client().get("/metrics").content.decode()
    )


@pytest.mark.django_db
def test_results_are_counted_by_outcome():
    before = RESULTS.labels(outcome="success", applied="true")._value.get()
    RESULTS.labels(outcome="success", applied="true").inc()
    assert scrape()['cloacina_fleet_results_total{applied="true",outcome="success"}'] == before + 1


@pytest.mark.django_db
def test_waiting_tasks_say_why_when_no_agent_can_take_them(tenant):
    two_task_package(tenant)
    _, task = ready_root(tenant)
    assert explain_waiting_tasks() == 1
    task.refresh_from_db()
    assert task.wait_reason == "no live agent in tenant acme"
    assert explain_waiting_tasks() == 0  # unchanged reasons are not rewritten
    make_agent(tenant, "w", max_concurrency=1, in_flight=1)
    explain_waiting_tasks()
    assert TaskExecution.objects.get(pk=task.pk).wait_reason == "the 1 live agent is at capacity"
    make_agent(tenant, "free")
    TaskExecution.objects.filter(pk=task.pk).update(wait_reason="")
    assert explain_waiting_tasks() == 0  # an agent has room: dispatch will take it
