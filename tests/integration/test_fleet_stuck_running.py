"""No interleaving leaves a run Running for ever (the server's half; the agent's half is
tests/unit/test_agent_repeated_push.py, the whole scenario tests/e2e/test_fleet_reregistration_e2e.py).

* Re-pushes of one packet are bounded: ``CLOACINA_OUTBOX_MAX_PUSHES`` unconfirmed
  pushes to one agent and the run is declared lost, through the task's retry policy.
* An outcome an agent process reports under its old (dead) agent id, for a packet
  since moved to its new registration, is applied once — or counted a duplicate.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agents.models import Agent
from fleet.executors.fleet.delivery.metrics import UNCONFIRMED_LOST
from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.delivery.redelivery import redeliver_unreceived
from fleet.executors.fleet.lifecycle import sweep_dead_agents
from fleet.models import DeliveryOutbox, TaskExecution, TaskOutcome
from fleet.platform.config import apply_overrides
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package
from tests.support.keys import bearer

pytestmark = pytest.mark.usefixtures("short_liveness")


def _placed(tenant, agent):
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert row.agent_id == agent.id
    return task, row


def _pushed_long_ago(row) -> None:
    """The relay pushed it (again) and no ``received`` came within the window."""
    DeliveryOutbox.objects.filter(pk=row.pk).update(
        state="delivered",
        delivered_at=timezone.now() - timedelta(seconds=60),
        received_at=None,
    )


@pytest.mark.django_db
def test_a_packet_pushed_max_pushes_times_without_confirmation_is_declared_lost(tenant):
    two_task_package(tenant, retries=1, retry_backoff_s=0)
    agent = make_agent(tenant, max_concurrency=2)
    task, row = _placed(tenant, agent)
    assert Agent.objects.get(pk=agent.pk).in_flight == 1
    lost_before = UNCONFIRMED_LOST._value.get()

    for push in (1, 2):  # the first two unconfirmed pushes are pushed again
        _pushed_long_ago(row)
        assert redeliver_unreceived(10.0, max_pushes=3) == 1
        row.refresh_from_db()
        assert (row.state, row.redeliveries) == ("pending", push)
        assert TaskExecution.objects.get(pk=task.pk).status == "Running"

    _pushed_long_ago(row)  # the third: no more
    assert redeliver_unreceived(10.0, max_pushes=3) == 0

    row.refresh_from_db()
    assert row.state == "acked"
    task.refresh_from_db()
    # Lost goes through the retry policy like any lost run: attempt 2 is Ready.
    assert (task.status, task.error_type) == ("Ready", "PacketUnconfirmed")
    assert "pushed 3 times" in task.error_message
    outcome = TaskOutcome.objects.get(task_execution=task)
    assert (outcome.outcome, outcome.applied) == ("lost", True)
    assert Agent.objects.get(pk=agent.pk).in_flight == 0  # its slot is free again
    assert UNCONFIRMED_LOST._value.get() == lost_before + 1


@pytest.mark.django_db
def test_the_default_bound_comes_from_the_configuration(tenant):
    apply_overrides(heartbeat_interval_s=0.5, liveness_misses=3, outbox_max_pushes=1)
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = _placed(tenant, agent)
    _pushed_long_ago(row)
    assert redeliver_unreceived(10.0) == 0
    task.refresh_from_db()
    assert task.status in ("Ready", "Failed") and task.error_type == "PacketUnconfirmed"


@pytest.mark.django_db
def test_a_confirmed_packet_is_never_declared_lost_by_the_bound(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    task, row = _placed(tenant, agent)
    DeliveryOutbox.objects.filter(pk=row.pk).update(
        state="delivered",
        delivered_at=timezone.now() - timedelta(days=1),
        received_at=timezone.now() - timedelta(days=1),
        redeliveries=10,
    )
    assert redeliver_unreceived(10.0, max_pushes=1) == 0
    assert TaskExecution.objects.get(pk=task.pk).status == "Running"


@pytest.mark.django_db
def test_a_reclaimed_packet_gets_a_fresh_share_of_pushes_on_its_new_agent(tenant):
    two_task_package(tenant)
    doomed = make_agent(tenant, "doomed", max_concurrency=1)
    task, row = _placed(tenant, doomed)
    DeliveryOutbox.objects.filter(pk=row.pk).update(redeliveries=4)
    survivor = make_agent(tenant, "survivor", max_concurrency=1)
    Agent.objects.filter(pk=doomed.pk).update(last_heartbeat="2000-01-01T00:00:00Z")
    sweep_dead_agents()
    row.refresh_from_db()
    assert (row.agent_id, row.state, row.redeliveries) == (survivor.id, "pending", 0)


# -- an outcome owed under an old registration of the same process ------------------------


def _report(client, key, agent, task, row, **body):
    payload = {
        "outbox_id": row.id,
        "task_execution_id": str(task.pk),
        "assignment": row.assignment,
        "outcome": "success",
        "output": {"done": True},
        **body,
    }
    return client.post(
        f"/api/v1/agents/{agent.id}/results",
        data=json.dumps(payload),
        content_type="application/json",
        **bearer(key),
    )


def _moved_to_new_registration(tenant, same_process: bool):
    """An agent process's packet, reclaimed after its registration died onto the same
    process's new registration (same instance_id) — or onto another process."""
    process = uuid.uuid4()
    old = make_agent(tenant, "bars-a0", max_concurrency=1)
    Agent.objects.filter(pk=old.pk).update(instance_id=process)
    task, row = _placed(tenant, old)
    Agent.objects.filter(pk=old.pk).update(last_heartbeat="2000-01-01T00:00:00Z")
    sweep_dead_agents()  # evicted; no survivor yet: the packet waits
    new = make_agent(tenant, "bars-a0", max_concurrency=1)
    Agent.objects.filter(pk=new.pk).update(instance_id=process if same_process else uuid.uuid4())
    sweep_dead_agents()  # the orphan moves onto the new registration
    row.refresh_from_db()
    assert row.agent_id == new.id and str(old.id) in row.former_agents
    return old, new, task, row


@pytest.mark.django_db(transaction=True)  # the result endpoint works on its own DB threads
def test_an_outcome_reported_under_the_old_id_of_the_same_process_is_applied_once(
    tenant, agent_key
):
    two_task_package(tenant)
    old, new, task, row = _moved_to_new_registration(tenant, same_process=True)
    client = Client()

    first = _report(client, agent_key, old, task, row)
    assert (first.status_code, first.json()["applied"]) == (200, True)
    task.refresh_from_db()
    assert (task.status, task.output_context) == ("Completed", {"done": True})
    row.refresh_from_db()
    assert row.state == "acked"
    assert Agent.objects.get(pk=new.pk).in_flight == 0

    # The same outcome again, now under the new id (the agent's answer to a re-push):
    again = _report(client, agent_key, new, task, row)
    assert (again.status_code, again.json()["applied"]) == (200, False)
    applied = TaskOutcome.objects.filter(task_execution=task, applied=True).count()
    assert applied == 1


@pytest.mark.django_db(transaction=True)
def test_an_outcome_under_the_old_id_of_another_process_stays_fenced(tenant, agent_key):
    two_task_package(tenant)
    old, new, task, row = _moved_to_new_registration(tenant, same_process=False)
    late = _report(Client(), agent_key, old, task, row)
    assert late.json() == {
        "applied": False,
        "reason": "the task is no longer assigned to this agent",
    }
    assert TaskExecution.objects.get(pk=task.pk).status == "Running"


@pytest.mark.django_db(transaction=True)
def test_registration_records_the_agent_process_id(tenant, agent_key):
    process = str(uuid.uuid4())
    body = {
        "name": "p1",
        "target_triple": "x86_64-unknown-linux-gnu",
        "protocol_version": 1,
        "instance_id": process,
    }
    response = Client().post(
        "/api/v1/agents/register",
        data=json.dumps(body),
        content_type="application/json",
        **bearer(agent_key),
    )
    assert response.status_code == 201, response.content
    agent = Agent.objects.get(pk=response.json()["agent_id"])
    assert str(agent.instance_id) == process
    bad = Client().post(
        "/api/v1/agents/register",
        data=json.dumps({**body, "name": "p2", "instance_id": "not-a-uuid"}),
        content_type="application/json",
        **bearer(agent_key),
    )
    assert bad.status_code == 422
    assert not Agent.objects.filter(name="p2").exists()
