"""Dead agents: the sweep, the eviction record, reclaim onto survivors, orphans, fencing."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from agents.models import Agent
from fleet.executors.fleet.delivery.liveness import reclaim_in_flight
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.lifecycle import sweep_dead_agents
from fleet.models import DeliveryOutbox, Eviction, TaskExecution, TaskOutcome
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.keys import bearer

pytestmark = pytest.mark.usefixtures("short_liveness")


def _running_on(tenant, agent, delivered=True):
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert row.agent_id == agent.id
    if delivered:
        DeliveryOutbox.objects.filter(pk=row.pk).update(
            state="delivered",
            delivered_at="2030-01-01T00:00:00Z",
            received_at="2030-01-01T00:00:00Z",
        )
        TaskExecution.objects.filter(pk=task.pk).update(result_deadline="2030-01-01T00:00:00Z")
    return task, row


@pytest.mark.django_db
def test_a_silent_agent_is_evicted_and_its_work_moves_to_a_survivor(tenant):
    two_task_package(tenant)
    doomed = make_agent(tenant, "doomed", max_concurrency=1)
    task, row = _running_on(tenant, doomed)
    survivor = make_agent(tenant, "survivor", max_concurrency=1)
    Agent.objects.filter(pk=doomed.pk).update(last_heartbeat="2000-01-01T00:00:00Z")

    [eviction] = sweep_dead_agents()

    doomed.refresh_from_db()
    assert (doomed.state, doomed.connected_to) == ("dead", "")
    assert (eviction.agent_id, eviction.tenant_id, eviction.agent_name) == (
        doomed.id,
        tenant.pk,
        "doomed",
    )
    assert eviction.last_heartbeat.year == 2000 and eviction.in_flight == 1
    assert "no heartbeat for 1.5s (3 missed beats of 0.5s)" == eviction.reason
    eviction.refresh_from_db()
    assert eviction.reassigned == 1
    moved = DeliveryOutbox.objects.get(pk=row.pk)
    assert (moved.agent_id, moved.state, moved.assignment) == (
        survivor.id,
        "pending",
        row.assignment,
    )
    assert (moved.delivered_at, moved.received_at, moved.former_agents) == (
        None,
        None,
        [str(doomed.id)],
    )
    task.refresh_from_db()
    assert (task.agent_id, task.result_deadline, task.status) == (survivor.id, None, "Running")
    survivor.refresh_from_db()
    assert survivor.in_flight == 1
    assert sweep_dead_agents() == []  # evicted once


@pytest.mark.django_db
def test_an_agent_that_beats_is_not_evicted(tenant):
    make_agent(tenant, "fine", heartbeat_age_s=1.0)
    make_agent(tenant, "draining", state="draining", heartbeat_age_s=1.0)
    assert sweep_dead_agents() == []
    assert not Agent.objects.filter(state="dead").exists()


@pytest.mark.django_db
def test_work_with_no_survivor_waits_and_moves_when_an_agent_appears(tenant, other_tenant):
    two_task_package(tenant)
    doomed = make_agent(tenant, "doomed")
    task, row = _running_on(tenant, doomed)
    make_agent(other_tenant, "foreign")  # never a survivor for another tenant's work
    Agent.objects.filter(pk=doomed.pk).update(last_heartbeat="2000-01-01T00:00:00Z")

    [eviction] = sweep_dead_agents()
    assert DeliveryOutbox.objects.get(pk=row.pk).agent_id == doomed.id
    assert sweep_dead_agents() == []  # still nowhere to go
    assert DeliveryOutbox.objects.get(pk=row.pk).agent_id == doomed.id

    late = make_agent(tenant, "late")
    sweep_dead_agents()
    moved = DeliveryOutbox.objects.get(pk=row.pk)
    assert (moved.agent_id, moved.state) == (late.id, "pending")
    eviction.refresh_from_db()
    assert (eviction.in_flight, eviction.reassigned) == (1, 1)


@pytest.mark.django_db
def test_reclaim_only_moves_work_to_agents_with_room(tenant):
    two_task_package(tenant)
    doomed = make_agent(tenant, "doomed", max_concurrency=3)
    rows = [_running_on(tenant, doomed)[1] for _ in range(3)]
    survivor = make_agent(tenant, "survivor", max_concurrency=2)
    Agent.objects.filter(pk=doomed.pk).update(state="dead")
    assert reclaim_in_flight(doomed.id) == (2, 1)
    survivor.refresh_from_db()
    assert survivor.in_flight == 2
    owners = sorted(str(DeliveryOutbox.objects.get(pk=r.pk).agent_id) for r in rows)
    assert owners == sorted([str(survivor.id)] * 2 + [str(doomed.id)])


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_a_late_result_from_an_evicted_agent_is_recorded_not_applied(tenant, agent_key):
    two_task_package(tenant)
    doomed = make_agent(tenant, "doomed", max_concurrency=1)
    task, row = _running_on(tenant, doomed)
    survivor = make_agent(tenant, "survivor", max_concurrency=1)
    Agent.objects.filter(pk=doomed.pk).update(last_heartbeat="2000-01-01T00:00:00Z")
    sweep_dead_agents()
    client = Client()
    body = {
        "outbox_id": row.id,
        "task_execution_id": str(task.pk),
        "assignment": row.assignment,
        "outcome": "failure",
        "error_type": "Boom",
        "error_message": "late",
    }

    def report(agent, payload):
        return client.post(
            f"/api/v1/agents/{agent.id}/results",
            data=json.dumps(payload),
            content_type="application/json",
            **bearer(agent_key),
        )

    late = report(doomed, body)
    assert late.status_code == 200
    assert late.json() == {
        "applied": False,
        "reason": "the task is no longer assigned to this agent",
    }
    task.refresh_from_db()
    assert task.status == "Running"
    ok = report(survivor, {**body, "outcome": "success", "output": {"a": 1}})
    assert ok.json()["applied"] is True
    task.refresh_from_db()
    assert (task.status, task.output_context) == ("Completed", {"a": 1})
    outcomes = list(
        TaskOutcome.objects.filter(task_execution=task)
        .order_by("id")
        .values_list("agent_name", "applied")
    )
    assert outcomes == [("doomed", False), ("survivor", True)]
    assert Eviction.objects.get(agent=doomed).reassigned == 1
