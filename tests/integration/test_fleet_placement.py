"""Placing a task on the fleet: one transaction claim → context → reservation → outbox row."""

from __future__ import annotations

import json

import pytest

from agents.models import Agent
from fleet.engine.context import build_task_context, encode_context
from fleet.engine.events import ExecutionStatus
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet.delivery.placement import (
    NoAgent,
    NotClaimed,
    Placed,
    place_task,
    run_status,
)
from fleet.models import DeliveryOutbox, TaskExecution
from tests.support.agents import make_agent
from tests.support.factories import ready_root, start, two_task_package


@pytest.mark.django_db
def test_it_claims_reserves_and_enqueues_a_packet(tenant):
    package = two_task_package(tenant)
    agent = make_agent(tenant, "w1")
    execution, task = ready_root(tenant, {"input": "x", "n": [1, 2]})
    placed = place_task(task.pk, "server-1")
    assert isinstance(placed, Placed) and placed.agent_id == agent.id
    task.refresh_from_db()
    assert (task.status, task.attempt, task.agent_id) == ("Running", 1, agent.id)
    assert task.result_deadline is None  # the clock starts at delivery
    agent.refresh_from_db()
    assert agent.in_flight == 1
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert (row.state, row.agent_id, row.assignment, row.attempts) == (
        "pending",
        agent.id,
        task.assignment,
        0,
    )
    assert row.payload == {
        "task_execution_id": str(task.pk),
        "assignment": task.assignment,
        "attempt": 1,
        "workflow_execution_id": str(execution.pk),
        "task_name": "a",
        "function": "demo.steps:a",
        "context_json": encode_context(build_task_context(task.pk)),
        "artifact_digest": package.digest,
        "package_kind": "python",
        "target_triple": agent.target_triple,
        "timeout_s": 300.0,
        "tenant": "acme",
    }


@pytest.mark.django_db
def test_the_packet_carries_the_shared_builders_exact_bytes(tenant):
    two_task_package(tenant)
    make_agent(tenant)
    execution, tasks = start(tenant, "demo", {"ünïcode": "✓", "f": 1.5, "nested": {"k": [None]}})
    a = tasks["a"]
    assert isinstance(place_task(a.pk, "s"), Placed)
    row = DeliveryOutbox.objects.get(task_execution=a)
    result_handler.apply(
        TaskReport(
            a.pk, row.assignment, "success", output={"a": 1, "f": 2.5}, agent_id=row.agent_id
        )
    )
    b = TaskExecution.objects.get(workflow_execution=execution, task_name="b")
    assert isinstance(place_task(b.pk, "s"), Placed)
    packet = DeliveryOutbox.objects.get(task_execution=b).payload
    assert packet["context_json"] == encode_context(build_task_context(b.pk))
    assert json.loads(packet["context_json"]) == {
        "ünïcode": "✓",
        "f": 2.5,
        "nested": {"k": [None]},
        "a": 1,
    }


@pytest.mark.django_db
def test_no_agent_releases_the_claim_without_using_an_attempt(tenant):
    two_task_package(tenant)
    _, task = ready_root(tenant)
    result = place_task(task.pk, "s")
    assert result == NoAgent(tenant.pk, "no live agent in tenant acme")
    task.refresh_from_db()
    assert (task.status, task.attempt, task.agent_id) == ("Ready", 0, None)
    assert task.wait_reason == "no live agent in tenant acme"
    assert not DeliveryOutbox.objects.exists()


@pytest.mark.django_db
def test_full_agents_make_the_task_wait_and_say_so(tenant):
    two_task_package(tenant)
    make_agent(tenant, "w1", max_concurrency=1, in_flight=1)
    make_agent(tenant, "w2", max_concurrency=1, in_flight=1)
    _, task = ready_root(tenant)
    assert isinstance(place_task(task.pk, "s"), NoAgent)
    task.refresh_from_db()
    assert task.wait_reason == "all 2 live agents are at capacity"
    assert list(Agent.objects.values_list("in_flight", flat=True)) == [1, 1]


@pytest.mark.django_db
def test_a_task_that_is_not_ready_is_not_claimed(tenant):
    two_task_package(tenant)
    make_agent(tenant)
    execution, tasks = start(tenant, "demo")
    assert isinstance(place_task(tasks["b"].pk, "s"), NotClaimed)  # NotStarted
    assert isinstance(place_task(tasks["a"].pk, "s"), Placed)
    assert isinstance(place_task(tasks["a"].pk, "s"), NotClaimed)  # already Running
    assert DeliveryOutbox.objects.count() == 1


@pytest.mark.django_db
def test_run_status_follows_the_database(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    _, task = ready_root(tenant)
    placed = place_task(task.pk, "s")
    assert run_status(task.pk, placed.assignment) is None  # still running, no deadline yet
    result_handler.apply(
        TaskReport(task.pk, placed.assignment, "success", output={}, agent_id=agent.id)
    )
    assert run_status(task.pk, placed.assignment) == ExecutionStatus.COMPLETED
    assert run_status(task.pk, placed.assignment + 7) == ExecutionStatus.SUPERSEDED


@pytest.mark.django_db
def test_run_status_declares_a_run_lost_after_its_deadline(tenant):
    two_task_package(tenant, retries=1)
    make_agent(tenant)
    _, task = ready_root(tenant)
    placed = place_task(task.pk, "s")
    TaskExecution.objects.filter(pk=task.pk).update(
        result_deadline="2000-01-01T00:00:00Z"
    )  # delivered long ago, never answered
    assert run_status(task.pk, placed.assignment) == ExecutionStatus.RETRY
    task.refresh_from_db()
    assert (task.status, task.error_type) == ("Ready", "ResultLost")
    assert DeliveryOutbox.objects.get(task_execution=task).state == "acked"
